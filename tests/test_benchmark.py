import json

import pytest
import torch

import benchmark
import data
from model import PRESETS, count_params

ROW_FIELDS = {'name', 'batch_size', 'precision', 'ms_per_iter', 'img_per_s', 'tflops', 'mfu', 'mfu_a100',
              'speedup', 'peak_mem_gb'}


@pytest.fixture(scope='module')
def ladder_result(tmp_path_factory):
    out = tmp_path_factory.mktemp('results')
    result = benchmark.main(['--device', 'cpu', '--preset', 'tiny', '--quick', '--out-dir', str(out), '--data-dir', str(out / 'data')])
    return out, result


def test_cpu_ladder_writes_json_markdown_and_png(ladder_result):
    out, _ = ladder_result
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == ['cpu-tiny.json', 'cpu-tiny.md', 'cpu-tiny.png']
    if data.ffcv_missing_reason() is None:  # the FFCV row wrote its .beton next to the data
        assert list((out / 'data').glob('*.beton'))
    saved = json.loads((out / 'cpu-tiny.json').read_text())
    for key in ('device', 'torch', 'date', 'commit', 'command', 'preset', 'image_size', 'flops_per_image', 'rows', 'peer'):
        assert key in saved
    assert {'forward', 'train', 'method'} <= set(saved['flops_per_image'])
    assert saved['flops_per_image']['torchinfo_train'] > 0
    assert (out / 'cpu-tiny.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert '| Baseline' in (out / 'cpu-tiny.md').read_text()


def test_cpu_ladder_rows(ladder_result):
    _, result = ladder_result
    names = [row['name'] for row in result['rows']]
    assert names[0].startswith('Baseline') and 'torch.compile' in names and 'PyTorch SDPA' in names
    measured = [row for row in result['rows'] if 'skipped' not in row]
    assert len(measured) >= 7  # every row a CPU can run
    for row in measured:
        assert ROW_FIELDS <= set(row)
        assert row['ms_per_iter'] > 0
        assert row['img_per_s'] == pytest.approx(row['batch_size'] / row['ms_per_iter'] * 1e3)
        assert row['tflops'] == pytest.approx(row['img_per_s'] * result['flops_per_image']['train'] / 1e12)
        assert row['mfu'] is None  # a CPU has no peak in the table: no guess
    assert measured[0]['speedup'] == 1.0
    skipped = {row['name']: row['skipped'] for row in result['rows'] if 'skipped' in row}
    assert 'FFCV data loading' in skipped or 'FFCV data loading' in [r['name'] for r in measured]
    # The settings accumulate: each row keeps the changes above it.
    settings = {row['name']: row['settings'] for row in result['rows']}
    assert settings['Fused Adam']['compile'] and settings['Fused Adam']['attention'] == 'sdpa'
    assert settings['Fused Adam']['amp'] == 'bf16' and settings['Fused Adam']['channels_last']


def test_peer_row_is_the_same_architecture(ladder_result):
    pytest.importorskip('diffusers')
    _, result = ladder_result
    peer = result['peer']
    assert peer['img_per_s'] > 0 and peer['ratio'] > 0
    ours, theirs = benchmark.UNet(PRESETS['ddpm-cifar10']), benchmark.DiffusersUNet(PRESETS['ddpm-cifar10'])
    assert count_params(theirs) == count_params(ours) == 35_746_307


def test_profile_mode(tmp_path):
    result = benchmark.main(['--device', 'cpu', '--preset', 'tiny', '--quick', '--out-dir', str(tmp_path), '--data-dir', str(tmp_path), '--profile'])
    for ext in ('json', 'md', 'png'):
        assert (tmp_path / f'cpu-tiny-profile.{ext}').exists()
    assert (tmp_path / 'traces' / 'cpu-tiny-profile.json').exists()
    assert {'conv / matmul', 'norm', 'attention', 'optimizer'} <= set(result['categories'])
    assert result['total_ms_per_iter'] > 0


def test_sweep_and_loader_modes(tmp_path):
    sweep = benchmark.main(['--device', 'cpu', '--preset', 'tiny', '--quick', '--out-dir', str(tmp_path), '--data-dir', str(tmp_path), '--sweep', 'amp'])
    assert [row['name'] for row in sweep['rows']] == ['amp off', 'amp bf16']
    assert (tmp_path / 'cpu-tiny-sweep-amp.png').exists()
    loaders = benchmark.main(['--device', 'cpu', '--preset', 'tiny', '--quick', '--out-dir', str(tmp_path), '--data-dir', str(tmp_path), '--loader-only'])
    delivered = {row['name']: row for row in loaders['loaders']}
    assert delivered['gpu (device-resident)']['img_per_s'] > 0
    assert delivered['torch DataLoader, 2 workers']['img_per_s'] > 0
    assert loaders['step_img_per_s'] > 0
    if data.ffcv_missing_reason() is None:
        ffcv_rows = [row for row in loaders['loaders'] if row['name'].startswith('FFCV')]
        assert ffcv_rows and ffcv_rows[0]['img_per_s'] > 0
    assert (tmp_path / 'cpu-tiny-loaders.png').exists()


def test_categories():
    assert benchmark.categorise('sm90_xmma_fprop_implicit_gemm_bf16') == 'conv / matmul'
    assert benchmark.categorise('aten::native_group_norm_backward') == 'norm'
    assert benchmark.categorise('pytorch_flash::flash_fwd_kernel') == 'attention'
    assert benchmark.categorise('void at::native::multi_tensor_apply_kernel<FusedAdam>') == 'optimizer'
    assert benchmark.categorise('triton_poi_fused_add_mul_0') == 'elementwise'


def test_mfu_uses_the_row_precision_and_overrides():
    bench = benchmark.BenchConfig(peak_tflops=100.0, peak_tflops_fp32=10.0)
    cpu = torch.device('cpu')
    assert benchmark.peak_for('bf16', cpu, bench) == 100.0
    assert benchmark.peak_for('tf32', cpu, bench) == 10.0
    assert benchmark.peak_for('bf16', cpu, benchmark.BenchConfig()) is None
    flops = {'train': 1e9, 'torchinfo_train': 0.9e9}
    row_cfg = benchmark.train.TrainConfig(batch_size=100, amp='bf16')
    described = benchmark.describe({'ms_per_iter': 10.0, 'peak_mem_gb': None}, row_cfg, bench, cpu, flops)
    assert described['img_per_s'] == pytest.approx(10_000)
    assert described['tflops'] == pytest.approx(10.0)
    assert described['mfu'] == pytest.approx(0.1)
    assert described['mfu_a100'] == pytest.approx(10.0 / 312)


def test_sampling_rows_in_the_ladder(ladder_result):
    out, result = ladder_result
    rows = {row['name']: row for row in result['sampling']}
    assert set(rows) == {'DDIM-50', 'DDPM-1000'}
    for row in rows.values():
        assert row['img_per_s'] > 0 and row['tflops'] > 0
    # DDPM takes 20x the model calls of DDIM-50.
    assert rows['DDPM-1000']['seconds_per_batch'] > 5 * rows['DDIM-50']['seconds_per_batch']
    assert 'DDIM-50' in (out / 'cpu-tiny.md').read_text()


def test_quality_mode(tmp_path):
    result = benchmark.main(['--device', 'cpu', '--preset', 'tiny', '--quick', '--out-dir', str(tmp_path), '--data-dir', str(tmp_path),
                             '--quality', '--steps', '6'])
    assert (tmp_path / 'quality-cpu-tiny.json').exists()
    names = [run['name'] for run in result['runs']]
    assert names == ['Baseline (fp32, eager, manual attention, DataLoader)', 'All speed-ups',
                     'Baseline (fp32, eager, manual attention, DataLoader)']
    assert [run['seed'] for run in result['runs']] == [0, 0, 1]
    for weights in ('model', 'ema'):
        c = result['comparison'][weights]
        assert abs(c['all_speedups']['relative_difference']) < 0.05  # same seed and data: close
        assert c['baseline_other_seed']['relative_difference'] != 0  # another seed does move it
        assert isinstance(result['agree_within_noise'][weights], bool)
