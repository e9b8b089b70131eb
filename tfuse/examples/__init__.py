"""Runnable examples of tfuse: ``python -m tfuse.examples.train`` trains a small ResNet end to end."""
