"""megaopd.data"""
