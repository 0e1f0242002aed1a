"""turboquant.pipeline"""
