"""megaopd.eval"""
