"""The device a script runs on: picking it, its autocast and precision, its name, and the data-sheet
peaks (FLOP/s, bandwidth) that MFU and the roofline are measured against."""
import contextlib
import os
import re

import torch

from cli import ConfigError


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """'auto' (CUDA when there is one), 'cpu', 'cuda' (this rank's GPU) or 'cuda:N'."""
    if name == 'auto':
        name = 'cuda' if torch.cuda.is_available() else 'cpu'
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ('cpu', 'cuda'):
        raise ConfigError(f'--device {name}: unknown device; use cpu, cuda or cuda:N')
    if device.type == 'cuda':
        if not torch.cuda.is_available():
            raise ConfigError(f'--device {name}: CUDA is not available here; use --device cpu')
        if device.index is None:
            device = torch.device('cuda', local_rank)
        if device.index >= torch.cuda.device_count():
            raise ConfigError(f'--device {name}: this machine has {torch.cuda.device_count()} GPU(s)')
    return device


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX-BF16, as /proc/cpuinfo lists its
    flags): where bf16 autocast is fast rather than emulated. False where the flags cannot be read."""
    with contextlib.suppress(OSError), open('/proc/cpuinfo') as f:
        flags = next((line.split(':', 1)[1].split() for line in f if line.startswith('flags')), [])
        return 'avx512_bf16' in flags or 'amx_bf16' in flags
    return False


def synchronize(device: torch.device):
    """Waits for the device's queued work (a no-op on the CPU, where work is synchronous)."""
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def own_rng(device: torch.device):
    """Work inside draws from the global RNGs (CPU, and the device's) without moving them: what
    evaluation builds or draws leaves the training run's random streams where they were."""
    return torch.random.fork_rng(devices=[device] if device.type == 'cuda' else [])


def autocast(amp: str, device: torch.device):
    """Autocast at 'bf16' or 'fp16'; 'off' runs as the weights are (fp32)."""
    dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16}.get(amp)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


# Dense (no sparsity) peak TFLOP/s by precision, from NVIDIA's data sheets. 'tf32' is what
# fp32 convolutions and matmuls reach when TF32 is allowed; 'fp32' is plain CUDA-core FP32.
GPU_PEAK_TFLOPS = {
    'H200': {'fp32': 67.0, 'tf32': 494.5, 'bf16': 989.5, 'fp16': 989.5},
    'H100 SXM': {'fp32': 67.0, 'tf32': 494.5, 'bf16': 989.5, 'fp16': 989.5},
    'H100 NVL': {'fp32': 60.0, 'tf32': 417.5, 'bf16': 835.5, 'fp16': 835.5},
    'H100 PCIe': {'fp32': 51.0, 'tf32': 378.0, 'bf16': 756.0, 'fp16': 756.0},
    'A100': {'fp32': 19.5, 'tf32': 156.0, 'bf16': 312.0, 'fp16': 312.0},
    'L40S': {'fp32': 91.6, 'tf32': 183.0, 'bf16': 362.05, 'fp16': 362.05},
    'A10G': {'fp32': 31.2, 'tf32': 62.5, 'bf16': 125.0, 'fp16': 125.0},
    'RTX 4090': {'fp32': 82.6, 'tf32': 82.6, 'bf16': 165.2, 'fp16': 165.2},
    'RTX 3090': {'fp32': 35.6, 'tf32': 35.6, 'bf16': 71.0, 'fp16': 71.0},
}
A100_PEAK_TFLOPS = GPU_PEAK_TFLOPS['A100']
# The GPUs benchmark.py --roofline knows by name: (data-sheet name, memory bandwidth in GB/s).
GPU_BANDWIDTH = {'h100-sxm': ('H100 SXM', 3350), 'h200': ('H200', 4800), 'a100-40gb': ('A100 40GB', 1555),
                 'a100-80gb': ('A100 80GB', 2039)}


def gpu_peak_key(device_name: str):
    """Maps a CUDA device name ('NVIDIA H100 80GB HBM3') to a GPU_PEAK_TFLOPS key, or None."""
    name = device_name.upper()
    if 'H200' in name:
        return 'H200'
    if 'H100' in name:
        if 'NVL' in name:
            return 'H100 NVL'
        return 'H100 PCIe' if 'PCIE' in name else 'H100 SXM'
    for key in ('A100', 'L40S', 'A10G', 'RTX 4090', 'RTX 3090'):
        if key.replace('RTX ', '') in name:
            return key
    return None


def device_slug(device: torch.device) -> str:
    """'cpu', or the GPU's data-sheet name as a file name ('h100-sxm'): the reports' stems."""
    if device.type != 'cuda':
        return 'cpu'
    name = torch.cuda.get_device_name(device)
    return re.sub(r'[^a-z0-9]+', '-', (gpu_peak_key(name) or name).lower()).strip('-')


def device_name(device: torch.device) -> str:
    """The GPU's name, or 'CPU (N cores, <model name from /proc/cpuinfo>)': what a report ran on."""
    if device.type == 'cuda':
        return torch.cuda.get_device_name(device)
    model = ''
    with contextlib.suppress(OSError), open('/proc/cpuinfo') as f:
        model = next((line.split(':', 1)[1].strip() for line in f if line.startswith('model name')), '')
    return f'CPU ({os.cpu_count()} cores{", " + model if model else ""})'


def precision_of(amp: str, device: torch.device) -> str:
    """The precision a run computes in, as GPU_PEAK_TFLOPS names it: its autocast dtype, else
    fp32, or tf32 where CUDA lets fp32 convolutions use TF32 tensor cores."""
    if amp != 'off':
        return amp
    return 'tf32' if device.type == 'cuda' and torch.backends.cudnn.allow_tf32 else 'fp32'


def peak_tflops(device_name: str, precision: str):
    """Dense peak for a device name and 'fp32' | 'tf32' | 'bf16' | 'fp16'; None if unknown."""
    key = gpu_peak_key(device_name)
    return GPU_PEAK_TFLOPS[key][precision] if key else None
