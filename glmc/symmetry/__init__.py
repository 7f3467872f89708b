"""The symmetry core: each family's spec as data, the transforms it admits, the groups they live in, canonical
forms (LayerNorms folded) and the exactness check that a transform leaves the function unchanged."""
