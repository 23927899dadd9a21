"""Prints every CUdevice_attribute of device 0 as JSON {number: value}, read through the driver API (libcuda)."""

import ctypes
import json

cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
device = ctypes.c_int()
assert cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
name = ctypes.create_string_buffer(256)
cuda.cuDeviceGetName(name, 256, device)
values = {}
for attribute in range(1, 160):
    value = ctypes.c_int()
    if cuda.cuDeviceGetAttribute(ctypes.byref(value), attribute, device) == 0:
        values[attribute] = value.value
total = ctypes.c_size_t()
cuda.cuDeviceTotalMem_v2(ctypes.byref(total), device)
print(json.dumps({"name": name.value.decode(), "total_memory_bytes": total.value, "attributes": values}, indent=1))
