"""turboquant.stages"""
