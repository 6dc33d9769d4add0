"""megaopd.rollout"""
