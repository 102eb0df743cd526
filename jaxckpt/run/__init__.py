"""A run on this process: opened explicitly, its peers met, its collective operations
choreographed. See README.md beside this file.
"""
