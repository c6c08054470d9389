"""Trained draft heads: EAGLE-3 and Medusa modules, their published formats, and where a head is.

Training them is `leapdecode.training` (it runs the decode loop and reads the benchmark's prompts
to keep them out of the data, so it sits above the drafters)."""
