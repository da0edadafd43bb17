"""specd.daemon"""
