"""The NVIDIA CUDA backend (torch.cuda, NCCL, shared Triton kernels). Importing it never touches the GPU."""
