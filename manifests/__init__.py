"""turboquant.manifests"""
