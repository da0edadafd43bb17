"""specd.ort_models.arch"""
