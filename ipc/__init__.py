"""specd.ipc"""
