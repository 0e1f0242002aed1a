"""turboquant.runtime"""
