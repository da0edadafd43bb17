"""specd.memory_fit"""
