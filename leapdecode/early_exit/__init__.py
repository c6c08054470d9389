"""Early exit and self-speculative decoding: run the target's own layers one by one.

`runner` runs any span of decoder layers; `backend` drives the target through it (and drafts
with a subset of its layers); `calm` exits tokens early (lossy); `calibrate` picks the layers
to skip.
"""
