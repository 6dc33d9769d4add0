"""megaopd.losses"""
