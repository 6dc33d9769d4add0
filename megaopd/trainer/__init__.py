"""megaopd.trainer"""
