"""Device implementations behind one seam (allocation, host transfer, commit kernels):
host.HostDevice (numpy, the CPU twin), torch_device.TorchDevice (torch tensors, our kernels on CUDA)."""
