"""megaopd.config"""
