"""megaopd.metrics"""
