"""Real training jobs for the fault lab (``megatrace lab``): small models trained with
``torch.distributed`` over Gloo, the PyTorch collector on, run one process per rank
inside the lab's network namespaces (:mod:`infra.netlab`)."""
