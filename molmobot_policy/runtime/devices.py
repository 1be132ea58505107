"""The serving device: checked where the `device` option enters, and described the way
`nvidia-smi` names a GPU, so that a start log confirms which GPU serves.

`cuda:N` counts the GPUs this process sees: with `CUDA_VISIBLE_DEVICES=2,3`, `cuda:0` is the
machine's GPU 2. CUDA numbers them fastest first unless `CUDA_DEVICE_ORDER=PCI_BUS_ID` (the
order of `nvidia-smi`), so the PCI bus id in the description is what identifies the GPU.
"""
from __future__ import annotations

import os

import torch


def _visible() -> str:
    """CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER as set (or 'unset') for messages."""
    return ', '.join(f'{name}={os.environ[name]!r}' if name in os.environ else f'{name} unset'
                     for name in ('CUDA_VISIBLE_DEVICES', 'CUDA_DEVICE_ORDER'))


def check_device(name: str) -> torch.device:
    """The torch device `name` ('cpu', 'cuda', 'cuda:N') if this process can serve on it.

    Raises:
        ValueError: naming the device: not a torch device string; a CUDA device with a torch
            built without CUDA; no CUDA device visible; N beyond the visible devices (the
            message gives how many are visible and CUDA_VISIBLE_DEVICES).
    """
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {name!r} is not a torch device; expected 'cpu', 'cuda' or "
                         "'cuda:N'") from None
    if device.type != 'cuda':
        return device
    if torch.version.cuda is None:
        raise ValueError(f'device {name!r}: this torch ({torch.__version__}) is built without '
                         'CUDA; install a CUDA build of torch, or serve on cpu')
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError(f'device {name!r}: no CUDA device is visible to this process '
                         f'({_visible()}); `nvidia-smi` lists the GPUs the driver sees')
    index = 0 if device.index is None else device.index
    if index >= count:
        raise ValueError(f"device {name!r}: {count} CUDA device{'s' if count > 1 else ''} "
                         f'visible, cuda:0 to cuda:{count - 1} ({_visible()}; cuda:N counts '
                         'the visible GPUs)')
    return device


def describe_device(name: str) -> str:
    """`name` checked (`check_device`, same errors) and described: 'cpu', or e.g.
    "cuda:1 = NVIDIA H200, 140 GiB, PCI bus 00000000:1B:00.0 (CUDA_VISIBLE_DEVICES unset,
    CUDA_DEVICE_ORDER unset)", the bus id as `nvidia-smi` prints it."""
    device = check_device(name)
    if device.type != 'cuda':
        return str(device)
    properties = torch.cuda.get_device_properties(device)
    text = f'{device} = {properties.name}, {properties.total_memory / 2**30:.0f} GiB'
    if hasattr(properties, 'pci_bus_id'):
        text += (f', PCI bus {getattr(properties, "pci_domain_id", 0):08X}:'
                 f'{properties.pci_bus_id:02X}:{getattr(properties, "pci_device_id", 0):02X}.0')
    return f'{text} ({_visible()})'
