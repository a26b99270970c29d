"""Training of the small long-context model this project ships (models/shadowkv-small): the synthetic RULER-style
tasks over natural-text haystacks that train and evaluate it (data), what the trainer measures of the keys against
ShadowKV's view of them (objectives), the trainer itself (train: `python -m training.train`) and its closing dense
evaluation (evaluate). May import torch, transformers and shadowkv_core; nothing imports it but the benchmarks and
the tests. Not part of the installed package: run from the repository root.
"""
