"""The model math in torch: the hybrid target (target.py), the DFlash drafter (drafter.py), their MLPs (mlp.py) and
the projection fusion of the GPU step (fuse.py). Export traces these modules; the torch backend runs them."""
