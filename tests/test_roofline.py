"""roofline.py and benchmark.py --roofline: one training step counted op by op on fake tensors and
bounded by a device's peaks; on the CPU, beside a profile of the same step."""
import functools
import json

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import benchmark
import roofline
from model import UNet, count_flops, count_params, get_config

H100 = (989.5, 3350)  # dense bf16 TFLOP/s, GB/s


@functools.lru_cache(maxsize=None)
def counted(preset: str, image_size: int, batch: int, precision: str = 'bf16') -> tuple:
    """The ops of the GPU's step as --roofline counts it (the start row at this batch and precision)."""
    bench = benchmark.BenchConfig(preset=preset, image_size=image_size, big_batch=batch, precision=precision)
    _, cfg = benchmark.roofline_step(bench, torch.device('cuda'))
    assert cfg.batch_size == batch and cfg.amp == {'fp32': 'off'}.get(precision, 'bf16') and cfg.fused_adam
    return tuple(roofline.count_step(cfg))


def bounds(preset, image_size, batch, precision='bf16'):
    return roofline.bounds(list(counted(preset, image_size, batch, precision)), batch, *H100)


def single_ops(work) -> dict:
    """op name -> (FLOPs, bytes) of what `work(fake tensors)` runs."""
    with FakeTensorMode():
        inputs = work(None)
        with roofline.StepCounter() as counter:
            work(inputs)
    return {op['op']: (op['flops'], op['bytes']) for op in counter.ops}


@pytest.mark.parametrize('preset, image_size', [('tiny', 16), ('ddpm-cifar10', 32)])
@pytest.mark.parametrize('batch', [2, 8])
def test_total_flops_are_flop_counter_modes_count_of_the_step(preset, image_size, batch):
    # The counted step runs SDPA (flash kernels); FlopCounterMode counts the network with matmul
    # attention (model.count_flops): the totals agree exactly, per image, at any batch.
    ops = counted(preset, image_size, batch)
    assert any(op['op'].startswith('aten._scaled_dot_product') and 'backward' in op['op'] for op in ops)
    expected = count_flops(get_config(preset, image_size=image_size), image_size)['train']
    assert sum(op['flops'] for op in ops) / batch == pytest.approx(expected, rel=1e-12)
    if preset == 'ddpm-cifar10':
        assert expected / 1e9 == pytest.approx(37.324, abs=5e-4)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float32])
def test_bytes_of_single_ops_are_the_tensors_they_read_and_write(dtype):
    size = torch.finfo(dtype).bits // 8
    n, c, h, w, out_c, groups = 4, 32, 8, 8, 64, 8

    def work(t):
        if t is None:
            return (torch.empty(n, c, h, w, dtype=dtype), torch.empty(out_c, c, 3, 3, dtype=dtype),
                    torch.empty(c, dtype=dtype), torch.empty(2, dtype=torch.long))
        x, weight, affine, index = t
        F.conv2d(x, weight, padding=1)
        F.group_norm(x, groups, affine, affine)
        F.silu(x)
        x.view(n, -1).t()  # views: no bytes
        x.add_(1.0)  # in place: read and written
        x[index]  # a gather reads the two images it returns, not the batch
        x.mul(affine[:1].expand(w))  # a broadcast (stride-0) input read once: one element
    ops = single_ops(work)
    image = c * h * w
    assert ops['aten.convolution.default'] == (2 * n * out_c * h * w * c * 9,
                                               (n * image + out_c * c * 9 + n * out_c * h * w) * size)
    # GroupNorm: x, its weight and bias in; y, and a mean and a 1/std per image and group, out.
    assert ops['aten.native_group_norm.default'] == (0, (2 * n * image + 2 * c + 2 * n * groups) * size)
    assert ops['aten.silu.default'] == (0, 2 * n * image * size)
    assert ops['aten.view.default'] == ops['aten.t.default'] == (0, 0)
    assert ops['aten.add_.Tensor'] == (0, 2 * n * image * size)
    assert ops['aten.index.Tensor'] == (0, 2 * 2 * image * size + 2 * 8)
    assert ops['aten.mul.Tensor'] == (0, (2 * n * image + 1) * size)


def test_a_large_matmul_is_bound_by_compute_and_an_elementwise_op_by_bandwidth():
    k = 8192

    def work(t):
        if t is None:
            return torch.empty(k, k, dtype=torch.bfloat16), torch.empty(k, k, dtype=torch.bfloat16)
        a, b = t
        a @ b
        a + b
    ops = [{'op': name, 'flops': flops, 'bytes': nbytes, 'category': category} for (name, (flops, nbytes)), category
           in zip(single_ops(work).items(), ('convolution and matmul', 'elementwise and activation'))]
    categories = roofline.bounds(ops, 1, *H100)['categories']
    matmul, add = categories['convolution and matmul'], categories['elementwise and activation']
    assert ops[0]['op'] == 'aten.mm.default' and ops[0]['flops'] == 2 * k ** 3
    assert matmul['eager_ms'] == matmul['flops_ms'] == pytest.approx(2 * k ** 3 / 989.5e12 * 1e3)  # 1.1 ms
    assert ops[0]['bytes'] / 3350e9 * 1e3 < matmul['eager_ms'] / 5  # its 402 MB would take 0.12 ms
    assert add['flops_ms'] == 0 and add['eager_ms'] == pytest.approx(3 * k * k * 2 / 3350e9 * 1e3)


def test_flops_alone_fused_and_eager_bounds_in_order_and_categories_sum_to_the_total():
    result = bounds('ddpm-cifar10', 32, 8)
    categories, total, cases = result['categories'], result['total'], result['cases']
    assert list(categories) == ['convolution and matmul', 'attention', 'normalisation', 'elementwise and activation',
                                'optimizer and EMA', 'data']
    for key in total:
        assert total[key] == pytest.approx(sum(c[key] for c in categories.values()))
    assert 0 < total['flops_ms'] < total['fused_ms'] < total['eager_ms']
    for c in categories.values():
        assert c['flops_ms'] <= c['fused_ms'] <= c['eager_ms']
    elementwise = categories['elementwise and activation']
    assert elementwise['fused_ms'] == 0 < elementwise['eager_ms']
    assert all(c['mb_per_image'] > 0 for c in categories.values())  # every category has work
    assert categories['attention']['gflop_per_image'] > 0 and categories['normalisation']['gflop_per_image'] == 0
    for name, c in categories.items():  # each category is the sum of its ops
        mine = [op for op in counted('ddpm-cifar10', 32, 8) if op['category'] == name]
        assert c['mb_per_image'] == pytest.approx(sum(op['bytes'] for op in mine) / 8e6)
        assert c['gflop_per_image'] == pytest.approx(sum(op['flops'] for op in mine) / 8e9)
        assert c['eager_ms'] == pytest.approx(sum(max(op['flops'] / 989.5e9, op['bytes'] / 3350e6) for op in mine))
    # The loader's work per image: gather 3,072 uint8 values by an int64 index, flip them, pick by a
    # bool flag, convert to fp32, divide, subtract.
    data_bytes = (2 * 3072 + 8) + 2 * 3072 + (1 + 3 * 3072) + (3072 + 4 * 3072) + 2 * (2 * 4 * 3072)
    assert categories['data']['mb_per_image'] == pytest.approx(data_bytes / 1e6)
    for case in ('eager', 'fused', 'flops'):
        assert cases[case]['img_per_s'] == pytest.approx(8e3 / total[f'{case}_ms'])
        assert cases[case]['mfu'] == pytest.approx(total['flops_ms'] / total[f'{case}_ms'])
    assert cases['flops']['mfu'] == pytest.approx(1.0)


def test_the_per_image_bound_amortises_the_weights_over_the_batch():
    small, large = bounds('ddpm-cifar10', 32, 2), bounds('ddpm-cifar10', 32, 8)
    params = count_params(UNet(get_config('ddpm-cifar10')))
    # Adam reads and writes its parameters and moments, the clip reads and scales the gradients, the
    # EMA reads both copies and writes one: at least 13 fp32 tensors of the parameters' size per step.
    per_step = small['categories']['optimizer and EMA']['mb_per_image'] * 2 * 1e6
    assert 13 * 4 * params <= per_step <= 14.5 * 4 * params
    assert large['categories']['optimizer and EMA']['mb_per_image'] == pytest.approx(per_step / 8 / 1e6)
    assert large['categories']['data']['mb_per_image'] == pytest.approx(small['categories']['data']['mb_per_image'])
    assert large['total']['mb_per_image'] < small['total']['mb_per_image']
    assert large['cases']['eager']['img_per_s'] > small['cases']['eager']['img_per_s']


def test_the_counted_step_is_cudas():
    # bf16 autocast as on CUDA: convolutions in bf16 (half their fp32 bytes), GroupNorm and
    # upsampling in fp32 (as CUDA's autocast runs them; the CPU's would keep bf16), dropout one
    # fused kernel, as CUDA runs it.
    half, full = counted('ddpm-cifar10', 32, 2), counted('ddpm-cifar10', 32, 2, 'fp32')

    def moved(ops, name):
        return sum(op['bytes'] for op in ops if op['op'] == name)
    assert moved(half, 'aten.convolution.default') == pytest.approx(moved(full, 'aten.convolution.default') / 2,
                                                                    rel=0.01)
    for name in ('aten.native_group_norm.default', 'aten.upsample_nearest2d.default'):
        assert moved(half, name) == moved(full, name) > 0
    assert moved(half, 'aten.native_dropout.default') > 0 and not moved(half, 'aten.bernoulli_.float')


def test_the_cpu_check_puts_measured_beside_bound(tmp_path):
    result = benchmark.main(['--roofline', '--profile', '--device', 'cpu', '--preset', 'tiny', '--quick',
                             '--precision', 'fp32', '--out-dir', str(tmp_path)])
    assert result['target']['slug'] == 'cpu' and result['target']['peak_tflops'] > 0
    assert result['target']['bandwidth_gbs'] > 0 and result['measured_against'] == 'eager'
    categories = result['categories']
    for name in ('convolution and matmul', 'attention', 'normalisation', 'elementwise and activation',
                 'optimizer and EMA'):
        assert categories[name]['measured_ms'] > 0 and categories[name]['eager_ms'] > 0, name
    assert result['total']['measured_ms'] == pytest.approx(sum(c['measured_ms'] for c in categories.values()))
    assert result['cases']['measured']['ms_per_step'] == result['total']['measured_ms']
    saved = json.loads((tmp_path / 'cpu-tiny-roofline-quick.json').read_text())
    assert saved['categories'] == categories and saved['cases'] == result['cases']
    markdown = (tmp_path / 'cpu-tiny-roofline-quick.md').read_text()
    assert '| eager bound (ms/step) |' in markdown and '| measured (ms/step) | measured / eager bound |' in markdown
    row = next(line for line in markdown.splitlines() if line.startswith('| normalisation |'))
    bound, ms = categories['normalisation']['eager_ms'], categories['normalisation']['measured_ms']
    assert f'| {bound:.3f} |' in row and f'| {ms:.3f} | {ms / bound:.2f} | {bound / ms:.1%} |' in row
    assert (tmp_path / 'cpu-tiny-roofline-quick.png').read_bytes()[:4] == b'\x89PNG'


def test_roofline_flags():
    cpu = torch.device('cpu')
    target = roofline.target(benchmark.BenchConfig(gpu='a100-80gb'), cpu)
    assert (target['peak_tflops'], target['bandwidth_gbs']) == (312.0, 2039)
    target = roofline.target(benchmark.BenchConfig(precision='fp32', peak_tflops_fp32=10.0, bandwidth_gbs=100.0),
                             cpu)
    assert (target['peak_tflops'], target['bandwidth_gbs'], target['slug']) == (10.0, 100.0, 'h100-sxm')
    assert roofline.target(benchmark.BenchConfig(profile=True), cpu) is None  # the CPU's, measured
    with pytest.raises(benchmark.ConfigError, match='--gpu is not read by --profile on a CPU'):
        benchmark.validate(benchmark.BenchConfig(roofline=True, profile=True, gpu='h200', device='cpu'))
    with pytest.raises(benchmark.ConfigError, match='not read by --profile on a CPU'):  # --profile alone too
        benchmark.validate(benchmark.BenchConfig(profile=True, gpu='h200', device='cpu'))
    # A GPU's bound is of the paper's model wherever it is computed; a CPU's own profile, of tiny.
    assert benchmark.resolve(benchmark.BenchConfig(roofline=True), cpu).preset == 'ddpm-cifar10'
    assert benchmark.resolve(benchmark.BenchConfig(roofline=True, profile=True), cpu).preset == 'tiny'
    assert benchmark.resolve(benchmark.BenchConfig(), cpu).preset == 'tiny'
    with pytest.raises(benchmark.ConfigError, match='choose one mode'):
        benchmark.validate(benchmark.BenchConfig(roofline=True, quality=True, device='cpu'))
