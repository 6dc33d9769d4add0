"""megaopd.models"""
