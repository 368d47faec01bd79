"""The outer loop: the controller, its actions, recovery, evaluation.
"""
