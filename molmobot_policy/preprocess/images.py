"""Camera images -> the uint8 patches the vision backbone reads, and the 2x2 pooling indices.

Upstream behaviour (../shared/golden/molmobot_tiny/README.md, section 5):
- every image is resized to 378 x 378 ignoring its aspect ratio, with no padding, by
  `torchvision.transforms.Resize([378, 378], BILINEAR, antialias=False)` on the uint8 CHW
  tensor, which computes `F.interpolate(bilinear, align_corners=False)` in float32, then
  `torch.round` (half to even), then casts to uint8;
- the 378 x 378 x 3 image is cut into 27 x 27 patches of 14 x 14 x 3, flattened in
  (patch_row, patch_col, dy, dx, channel) order -> (729, 588);
- the model normalizes the uint8 patches itself (x / 255 * 2 - 1), so nothing is
  normalized here.
The resize runs in torch so the same code serves the CPU path and the runtime's GPU path.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

IMAGE_SIZE = 378     # VitConfig.image_size
PATCH_SIZE = 14      # VitConfig.patch_size


def as_uint8_nhwc(images: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Validate and view `images` as a torch uint8 (N, H, W, 3) tensor.

    Returns the tensor and whether the input was a single (H, W, 3) image.
    """
    if isinstance(images, np.ndarray):
        tensor = torch.from_numpy(np.ascontiguousarray(images))
    elif isinstance(images, torch.Tensor):
        tensor = images
    else:
        raise TypeError('images must be a numpy array or a torch tensor, '
                        f'got {type(images).__name__}')
    if tensor.dtype != torch.uint8:
        raise ValueError(f'images must be uint8 RGB, got dtype {tensor.dtype}')
    if tensor.ndim not in (3, 4) or tensor.shape[-1] != 3:
        raise ValueError('images must have shape (H, W, 3) or (N, H, W, 3) with 3 RGB channels, '
                         f'got {tuple(tensor.shape)}')
    single = tensor.ndim == 3
    if single:
        tensor = tensor.unsqueeze(0)
    if tensor.numel() == 0:
        raise ValueError(f'images must be non-empty, got shape {tuple(tensor.shape)}')
    return tensor, single


def resize_images(images: np.ndarray | torch.Tensor, image_size: int = IMAGE_SIZE
                  ) -> torch.Tensor:
    """Resize to (image_size, image_size) the way upstream's torchvision Resize does.

    Args:
        images: uint8 RGB, (H, W, 3) or (N, H, W, 3); numpy array or torch tensor on any
            device.
    Returns:
        torch uint8 (N, image_size, image_size, 3) on the input's device (N = 1 for a
        single image).
    Raises:
        TypeError, ValueError: not an array, not uint8, not 3 channels, or empty.
    """
    tensor, _ = as_uint8_nhwc(images)
    # NCHW float32, contiguous as torchvision's CHW tensor is; bilinear, no antialias.
    x = tensor.permute(0, 3, 1, 2).contiguous().to(torch.float32)
    x = F.interpolate(x, size=(image_size, image_size), mode='bilinear', align_corners=False,
                      antialias=False)
    x = torch.round(x).clamp_(0, 255).to(torch.uint8)   # round half to even, like torchvision
    return x.permute(0, 2, 3, 1)


def patchify(images: torch.Tensor, patch_size: int = PATCH_SIZE) -> torch.Tensor:
    """(N, S, S, C) -> (N, (S/p)^2, p*p*C) in (patch_row, patch_col, dy, dx, channel) order.

    Patch index = patch_row * (S/p) + patch_col. Any dtype and device; S must be a
    multiple of patch_size (ValueError otherwise).
    """
    n, h, w, c = images.shape
    if h != w or h % patch_size:
        raise ValueError(f'patchify needs square images with a side divisible by {patch_size}, '
                         f'got {h}x{w}')
    g = h // patch_size
    x = images.reshape(n, g, patch_size, g, patch_size, c)
    x = x.permute(0, 1, 3, 2, 4, 5)                      # (n, row, col, dy, dx, c)
    return x.reshape(n, g * g, patch_size * patch_size * c)


def resize_and_patchify(images: np.ndarray | torch.Tensor, image_size: int = IMAGE_SIZE,
                        patch_size: int = PATCH_SIZE) -> np.ndarray | torch.Tensor:
    """Camera images -> uint8 patches for the vision backbone.

    Args:
        images: uint8 RGB (H, W, 3) or (N, H, W, 3), any H and W; numpy array, or torch
            tensor on any device (the runtime calls this on the GPU).
        image_size: square side after the resize (VitConfig.image_size, 378).
        patch_size: VitConfig.patch_size (14).
    Returns:
        Same kind as the input: numpy in -> numpy out, tensor in -> tensor on the same
        device. uint8 (729, 588) for a single image, (N, 729, 588) for a batch.
    Raises:
        TypeError, ValueError: not an array, not uint8, not 3 channels, or empty.
    """
    _, single = as_uint8_nhwc(images)
    patches = patchify(resize_images(images, image_size), patch_size)
    if single:
        patches = patches[0]
    if isinstance(images, np.ndarray):
        return patches.numpy()
    return patches


def pooling_indices(n_images: int, grid: int = 27, pool_h: int = 2, pool_w: int = 2
                    ) -> np.ndarray:
    """Patch indices pooled into each image token (upstream `token_pooling`).

    The grid x grid patch grid is padded on the bottom/right to a multiple of the pooling
    window, and each pool_h x pool_w window becomes one token, row-major. For image k,
    token r * out_w + c pools patches (pool_h*r + i) * grid + (pool_w*c + j) + k * grid^2
    for i < pool_h, j < pool_w (row-major within the window); positions in the padding are
    -1. Source: golden README section 5.

    Args:
        n_images: number of images, >= 1.
        grid: patches per side (27).
        pool_h, pool_w: pooling window (2, 2).
    Returns:
        int64 (n_images * out_h * out_w, pool_h * pool_w); (n * 196, 4) by default.
    Raises:
        ValueError: n_images < 1 or a non-positive grid/window.
    """
    if int(n_images) != n_images or n_images < 1:
        raise ValueError(f'n_images must be an integer >= 1, got {n_images!r}')
    if grid < 1 or pool_h < 1 or pool_w < 1:
        raise ValueError(f'grid, pool_h and pool_w must be >= 1, got {grid}, {pool_h}, {pool_w}')
    out_h, out_w = -(-grid // pool_h), -(-grid // pool_w)
    rows = (np.arange(out_h)[:, None, None, None] * pool_h
            + np.arange(pool_h)[None, None, :, None])        # (out_h, 1, pool_h, 1)
    cols = (np.arange(out_w)[None, :, None, None] * pool_w
            + np.arange(pool_w)[None, None, None, :])        # (1, out_w, 1, pool_w)
    rows, cols = np.broadcast_arrays(rows, cols)             # (out_h, out_w, pool_h, pool_w)
    valid = (rows < grid) & (cols < grid)
    index = np.where(valid, rows * grid + cols, -1).reshape(out_h * out_w, pool_h * pool_w)
    offsets = np.arange(int(n_images))[:, None, None] * grid * grid
    pooled = np.where(index >= 0, index[None] + offsets, -1)
    return pooled.reshape(-1, pool_h * pool_w).astype(np.int64)
