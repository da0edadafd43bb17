"""specd.tray"""
