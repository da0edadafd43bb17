"""specd.ort_models"""
