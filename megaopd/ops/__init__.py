"""megaopd.ops"""
