"""megaopd.sync"""
