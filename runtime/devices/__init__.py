"""Device implementations behind one seam (allocation, host transfer, commit kernels):
host.HostDevice (numpy, the CPU twin), torch_device.TorchDevice (torch tensors, our kernels on CUDA),
cuda.CudaDevice (cuda-python pools, the runtime's stream, pinned staging, CUDA graphs with the brick guard) and
torch_cpu.TorchCpuDevice (CudaDevice's step interface on CPU tensors: the GPU executor's logic, eagerly)."""
