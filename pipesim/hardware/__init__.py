"""The hardware both halves of the model read: each GPU's datasheet figures.

Below ``pipesim.cluster`` (which builds nodes and links from a GPU's NVLink and NIC) and
``pipesim.model`` (which prices kernels on its FLOPs, SMs and memory bandwidth), so that
those two sit side by side and neither imports the other.
"""
