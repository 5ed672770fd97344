"""benchmark.py and scripts/measure_gpu.sh on the CPU. One quick run of every part of the GPU
campaign (tiny preset) feeds most tests: its wiring is checked before a GPU is lent."""
import dataclasses
import gzip
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import NO_DIFFUSERS, refusal

import benchmark
import data
import devices
import diffusion
import peers
import profiling
import roofline
import timing
import train
from model import PRESETS, get_config

ROW_FIELDS = {'name', 'batch_size', 'precision', 'ms_per_iter', 'img_per_s', 'tflops', 'mfu', 'mfu_a100',
              'speedup', 'peak_mem_gb', 'compile_s'}
# measure_gpu.sh's parts but `fewstep`, whose quick run needs a teacher and its students: tests/test_distill.py
PARTS = ['step', 'knobs', 'headline', 'profile', 'ladder', 'gputests', 'autotune', 'graphs', 'quality', 'loaders',
         'sweep', 'small']


@pytest.fixture(scope='module')
def campaign(tmp_path_factory, root):
    """bash scripts/measure_gpu.sh PART OUT --quick for every part, as on the GPU, in its CPU
    form; two parts at a time, one thread each (their timings mean nothing on a CPU anyway)."""
    out = tmp_path_factory.mktemp('gpu-out')
    lanes = [['gputests', 'autotune', 'graphs', 'small', 'step', 'knobs', 'sweep'],  # about 2.5 minutes each
             ['ladder', 'quality', 'profile', 'headline', 'loaders']]
    assert sorted(sum(lanes, [])) == sorted(PARTS)
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    processes = [subprocess.Popen(['bash', '-c', ' && '.join(f'bash scripts/measure_gpu.sh {part} {out} --quick'
                                                          for part in lane)],
                                  cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for lane in lanes]
    outputs = [process.communicate(timeout=1500)[0] for process in processes]  # a loaded CPU: minutes
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-3000:]
    return out


def load(out, stem):
    return json.loads((out / f'{stem}.json').read_text())


@pytest.mark.xdist_group('campaign')  # one worker runs the campaign, once
def test_every_part_writes_at_most_eight_files(campaign):
    files = sorted(p.name for p in campaign.iterdir())
    assert not [p for p in campaign.iterdir() if p.is_dir()]  # data, .beton files and runs stay out
    for part in PARTS:
        mine = [f for f in files
                if f.split('.')[0].split('-')[0] == part or (part == 'profile' and f.startswith('sampling'))]
        assert f'{part}-environment.txt' in mine and f'{part}.log' in mine, part
        assert len(mine) <= 8, (part, mine)
    for stem in ('headline', 'ladder', 'profile', 'autotune', 'graphs', 'loaders', 'sweep', 'small', 'step-profile',
                 'knobs'):
        assert (campaign / f'{stem}.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert '| Baseline' in (campaign / 'ladder.md').read_text()


@pytest.mark.xdist_group('campaign')  # one worker runs the campaign, once
def test_ladder_rows(campaign):
    result = load(campaign, 'ladder')
    assert result['complete'] and result['peer'] is None
    for key in ('device', 'torch', 'date', 'commit', 'command', 'preset', 'image_size', 'flops_per_image'):
        assert key in result
    assert result['flops_per_image']['train'] > result['flops_per_image']['torchinfo_train'] > 0
    names = [row['name'] for row in result['rows']]
    assert names == result['rows_planned'] and not any('max-autotune' in n for n in names)
    measured = [row for row in result['rows'] if 'img_per_s' in row]
    assert len(measured) >= 8  # every default-compile row a CPU can run (FFCV only where installed)
    assert not any('reduce-overhead' in n for n in names)  # a CUDA graphs row: the graphs part's
    for row in measured:
        assert ROW_FIELDS <= set(row)
        assert row['img_per_s'] == pytest.approx(row['batch_size'] / row['ms_per_iter'] * 1e3)
        assert row['tflops'] == pytest.approx(row['img_per_s'] * result['flops_per_image']['train'] / 1e12)
        assert row['speedup'] == pytest.approx(row['img_per_s'] / measured[0]['img_per_s'])
        assert row['mfu'] is None  # a CPU has no peak in the table: no guess
    assert measured[0]['name'].startswith('Baseline') and measured[0]['precision'] == 'fp32'
    settings = {row['name']: row['settings'] for row in result['rows']}
    fused = settings['Fused Adam']  # the settings accumulate: each row keeps the changes above it ...
    assert fused['compile'] and fused['attention'] == 'sdpa' and fused['amp'] == 'bf16' and fused['fused_adam']
    tried = settings['Channels-last (tried: the rows below stay NCHW)']  # ... but a row that is only tried
    assert tried['channels_last'] and not fused['channels_last'] and not settings[names[-1]]['channels_last']
    assert {**tried, 'name': '', 'channels_last': False, 'carried': True} == {
        **settings[names[names.index(tried['name']) - 1]], 'name': ''}  # one change from the row above it
    for part, planned in [('autotune', ['compile max-autotune (no CUDA graphs)']),
                          ('graphs', ['compile reduce-overhead (CUDA graphs of the compiled loss)',
                                      'compile max-autotune + CUDA graphs'])]:
        rows = load(campaign, part)['rows']
        assert rows[0]['name'].startswith('Baseline') and [r['name'] for r in rows[1:]] == planned
        assert all('CUDA' in r['skipped'] for r in rows[1:])  # GPU modes, with the reason


@pytest.mark.xdist_group('campaign')  # one worker runs the campaign, once
def test_step_part_alternates_ours_and_the_peer_then_profiles_both(campaign):
    # measure_gpu.sh step: A B A B in one process, train.py's own log, both steps profiled side by
    # side, and the README's table generated from the JSON (into the log).
    pytest.importorskip('diffusers', reason=NO_DIFFUSERS)
    peer = load(campaign, 'step-peer')
    assert peer['complete'] and peer['sweep'] == 'peer' and peer['base_row'] == timing.start_row(
        benchmark.BenchConfig(), torch.device('cpu')).name
    assert [r['settings']['network'] for r in peer['rows']] == ['ours', 'diffusers', 'ours', 'diffusers']
    for ours, theirs in zip(peer['rows'][::2], peer['rows'][1::2]):  # the peer: our row's settings, its network
        assert {**theirs['settings'], 'name': '', 'network': 'ours'} == {**ours['settings'], 'name': ''}
    ours, theirs = ([r['img_per_s'] for r in peer['rows'][start::2]] for start in (0, 1))
    comparison = peer['comparison']
    assert comparison['ours_img_per_s'] == ours and comparison['peer_img_per_s'] == theirs
    assert comparison['ratio'] == pytest.approx(sum(ours) / sum(theirs))
    assert comparison['ratio_per_round'] == pytest.approx([o / t for o, t in zip(ours, theirs)])
    assert f"ours {comparison['ratio']:.3f}x" in (campaign / 'step-peer.md').read_text()
    profile = load(campaign, 'step-profile')
    assert profile['row'] == peer['base_row'] and not profile['compiled'] and profile['target']['slug'] == 'cpu'
    for key in ('ours', 'diffusers'):
        network = profile['networks'][key]
        shipped, eager, bounds = network['shipped'], network['eager'], network['bounds']
        for name in ('convolution and matmul', 'normalisation', 'attention', 'optimizer and EMA'):
            assert shipped['categories'][name] > 0 and bounds['categories'][name]['eager_ms'] > 0, (key, name)
        for group in (profiling.RES_NORM, profiling.RES_CONV, profiling.ATTENTION, profiling.SAMPLING,
                      profiling.OPTIMIZER, profiling.EMA):
            assert eager['modules'][group] > 0 and bounds['modules'][group]['eager_ms'] > 0, (key, group)
        assert sum(eager['modules'].values()) == pytest.approx(eager['ms_per_step'], rel=0.02)  # every op in a group
        assert sum(b['eager_ms'] for b in bounds['modules'].values()) == pytest.approx(bounds['total']['eager_ms'])
        # The backward is found in the modules whose forward made it: little is left outside the network.
        assert eager['modules'][profiling.OUTSIDE] < 0.25 * eager['ms_per_step'], eager['modules']
        assert bounds['modules'][profiling.OUTSIDE]['eager_ms'] < 0.05 * bounds['total']['eager_ms']
    assert (profile['networks']['ours']['bounds']['total']['gflop_per_image']
            == pytest.approx(profile['networks']['diffusers']['bounds']['total']['gflop_per_image']))  # one function
    markdown = (campaign / 'step-profile.md').read_text()
    assert '| ResBlocks: GroupNorm |' in markdown and 'Largest differences by category' in markdown
    rows = [json.loads(line) for line in (campaign / 'step-train-metrics.jsonl').read_text().splitlines()]
    assert rows[0]['config']['batch_size'] == 8 and rows[-1]['kind'] == 'done'
    log = (campaign / 'step.log').read_text()
    assert f"Ours {comparison['ratio']:.3f}x diffusers' UNet2DModel in our loop" in log and '| train.py (its own' in log
    knobs = load(campaign, 'knobs')
    assert [r['name'] for r in knobs['rows']] == [
        'Device-resident data (gpu loader, in RAM)', 'fused GroupNorm (Triton)', 'Twice the batch (16)',
        'cuDNN attention (SDPA backend)', 'Inductor coordinate-descent tuning']
    assert [('skipped' in r) for r in knobs['rows']] == [False, True, False, True, True]  # CUDA's, with the reason


def test_each_tried_row_changes_what_its_name_says(monkeypatch):
    # The rows after the fastest default row are each one change from it and carried into none below;
    # each change reaches what it names: train.py's config (and so the network), Inductor's config,
    # the SDPA backend, the batch. The modes still start from the fastest default row.
    cpu = torch.device('cpu')
    bench = benchmark.resolve(benchmark.BenchConfig(device='cpu', preset='tiny', image_size=16), cpu)
    rows = {r.name: r for r in timing.ladder(bench, cpu)}
    base = rows['Device-resident data (gpu loader, in RAM)']
    assert timing.start_row(bench, cpu) == base and base.carried
    expected = {'compile reduce-overhead (CUDA graphs of the compiled loss)': {'compile_mode': 'reduce-overhead'},
                'compile max-autotune (no CUDA graphs)': {'compile_mode': 'max-autotune-no-cudagraphs'},
                'compile max-autotune + CUDA graphs': {'compile_mode': 'max-autotune'},
                'fused GroupNorm (Triton)': {'fused_norm': True},
                f'Twice the batch ({2 * bench.big_batch})': {'batch_size': 2 * bench.big_batch},
                'cuDNN attention (SDPA backend)': {'sdpa_backend': 'cudnn'},
                'Inductor coordinate-descent tuning': {'coordinate_descent': True}}
    assert list(rows)[-len(expected):] == list(expected)
    for name, change in expected.items():
        assert dataclasses.replace(base, name=name, carried=False, **change) == rows[name], name
    fused = rows['fused GroupNorm (Triton)']
    cfg = timing.row_train_config(fused, bench, cpu, 'shapes')
    assert cfg.fused_norm and train.model_config_of(cfg).fused_norm
    assert not timing.row_train_config(base, bench, cpu, 'shapes').fused_norm
    seen = {}

    def spy(row_cfg, bench, device, dataset, make_model=None, compile_scope='loss'):
        from torch._inductor import config
        backends = [name for name in ('cudnn', 'flash', 'mem_efficient', 'math')
                    if getattr(torch.backends.cuda, f'{name}_sdp_enabled')()]
        seen[row_cfg.batch_size, row_cfg.fused_norm] = (config.coordinate_descent_tuning, backends, make_model)
        raise RuntimeError('stop here')
    monkeypatch.setattr(timing, 'build_row_run', spy)
    monkeypatch.setattr(timing, 'skip_reason', lambda row, device: None)  # CUDA's rows, built here
    dataset = data.ImageTensorDataset(data.make_shapes(64, 16))
    for name in ('Inductor coordinate-descent tuning', 'cuDNN attention (SDPA backend)'):
        seen.clear()
        assert 'stop here' in timing.measure_row(rows[name], bench, cpu, dataset, 'shapes', {})['failed']
        (tuning, backends, make_model), = seen.values()
        assert tuning == (name == 'Inductor coordinate-descent tuning') and make_model is None
        assert (backends == ['cudnn']) == (name == 'cuDNN attention (SDPA backend)'), backends
    from torch._inductor import config
    assert not config.coordinate_descent_tuning and torch.backends.cuda.flash_sdp_enabled()  # restored
    peer = timing.sweep_rows('peer', base, bench, cpu)
    assert [r.network for r in peer] == ['ours', 'diffusers'] * 2
    assert peer[0] == dataclasses.replace(base, name=peer[0].name) == dataclasses.replace(peer[2], name=peer[0].name)
    seen.clear()
    timing.measure_row(peer[1], bench, cpu, dataset, 'shapes', {})
    assert [v[2] for v in seen.values()] == [timing.DiffusersUNet]


@pytest.mark.xdist_group('campaign')  # one worker runs the campaign, once
def test_headline_peers_are_timed_beside_our_fastest_row(campaign):
    pytest.importorskip('diffusers', reason=NO_DIFFUSERS)
    result = load(campaign, 'headline')
    assert [r['name'].split(' ')[0] for r in result['rows']] == ['Baseline', 'Device-resident']
    fastest = max((r for r in result['rows'] if 'img_per_s' in r), key=lambda r: r['img_per_s'])
    markdown = (campaign / 'headline.md').read_text()
    for key, kind in (('peer', 'model'), ('recipe', 'recipe')):  # the same network in our loop; diffusers' loop
        peer = result[key]
        assert peer['kind'] == kind and peer['ours'] == fastest['name'] and peer['img_per_s'] > 0
        assert peer['batch_size'] == fastest['batch_size'] and peer['precision'] == fastest['precision']
        assert peer['ours_first']['img_per_s'] == fastest['img_per_s']
        assert peer['ratio'] == pytest.approx(peer['ours_again']['img_per_s'] / peer['img_per_s'])
        assert peer['ratio_first_timing'] == pytest.approx(fastest['img_per_s'] / peer['img_per_s'])
        assert f'timed again right after the {kind} peer' in markdown and f"| {peer['name']} |" in markdown
    assert result['recipe']['settings']['lr'] == 1e-4 and 'train_unconditional.py' in result['recipe']['name']
    # The peer is the same function (tests/test_reference_unet.py), built by model.diffusers_config.
    assert isinstance(benchmark.DiffusersUNet(PRESETS['tiny']).unet, __import__('diffusers').UNet2DModel)


def test_the_recipe_step_is_the_diffusers_examples_step():
    # The system peer's step against the same step written with diffusers' objects directly, in
    # the order of examples/unconditional_image_generation/train_unconditional.py, with its default
    # hyperparameters and EMA: 3 steps, bf16 autocast, bit for bit (loss, logged values, weights, EMA, lr).
    pytest.importorskip('diffusers', reason=NO_DIFFUSERS)
    import copy

    from diffusers import DDPMScheduler, UNet2DModel
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import EMAModel
    cpu = torch.device('cpu')
    torch.manual_seed(0)
    parts = peers.recipe_parts(get_config('tiny', image_size=16), cpu, steps_per_epoch=10, amp='bf16')
    unet = copy.deepcopy(parts['unet'])
    assert isinstance(unet, UNet2DModel)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4, betas=(0.95, 0.999), weight_decay=1e-6, eps=1e-8)
    lr_scheduler = get_scheduler('cosine', optimizer=optimizer, num_warmup_steps=500, num_training_steps=10 * 100)
    ema = EMAModel(unet.parameters(), decay=0.9999, use_ema_warmup=True, inv_gamma=1.0, power=3 / 4)
    noise_scheduler = DDPMScheduler(num_train_timesteps=1000)
    clean_images = torch.rand(4, 3, 16, 16) * 2 - 1
    for step in range(3):
        state = torch.get_rng_state()
        loss = peers.recipe_step(parts, clean_images)
        torch.set_rng_state(state)
        batch = clean_images.to(torch.bfloat16)  # the example's weight_dtype under bf16
        noise = torch.randn(batch.shape, dtype=torch.bfloat16)
        timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (4,)).long()
        noisy_images = noise_scheduler.add_noise(batch, noise, timesteps)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            model_output = unet(noisy_images, timesteps).sample
        expected = torch.nn.functional.mse_loss(model_output.float(), noise.float())
        expected.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        ema.step(unet.parameters())
        assert torch.equal(loss, expected.detach()), step
        assert parts['logs'] == {'loss': expected.item(), 'lr': lr_scheduler.get_last_lr()[0],
                                 'ema_decay': ema.cur_decay_value}  # read on the host each step, as the example logs
    for ours, theirs in [(parts['unet'].parameters(), unet.parameters()),
                         (parts['ema'].shadow_params, ema.shadow_params)]:
        assert all(torch.equal(p, q) for p, q in zip(ours, theirs))
    assert parts['ema'].cur_decay_value == ema.cur_decay_value > 0
    assert parts['lr_scheduler'].get_last_lr() == lr_scheduler.get_last_lr() == [1e-4 * 3 / 500]
    assert not torch.equal(parts['unet'].conv_out.weight, peers.recipe_parts(
        get_config('tiny', image_size=16), cpu, 10, 'bf16')['unet'].conv_out.weight)  # the steps moved the weights


def test_the_recipe_trains_from_the_images_as_files(tmp_path):
    # The system peer's data: the benchmark's images written once as PNG files, read back by
    # torchvision's ImageFolder and the example's transforms: every batch image is a source
    # image, maybe mirrored, in [-1, 1]; every image once per epoch.
    images = data.make_shapes(12, 16)
    bench = benchmark.BenchConfig(data_dir=str(tmp_path), image_size=16)
    folder = timing.image_folder_for(bench, 'shapes', data.ImageTensorDataset(images))
    assert sorted(os.listdir(folder)) == ['images'] and len(os.listdir(os.path.join(folder, 'images'))) == 12
    written = os.stat(os.path.join(folder, 'images', '000000.png')).st_mtime_ns
    assert timing.image_folder_for(bench, 'shapes', data.ImageTensorDataset(images)) == folder
    assert os.stat(os.path.join(folder, 'images', '000000.png')).st_mtime_ns == written  # written once
    loader = peers.recipe_loader(folder, 16, 4, num_workers=0)
    mirrored, orders = 0, []
    for epoch in range(3):
        seen = []
        for batch, _ in loader:
            for image in batch:
                pixels = ((image + 1) * 127.5).round().to(torch.uint8)
                (match,) = [i for i in range(12) if torch.equal(pixels, images[i])
                            or torch.equal(pixels.flip(-1), images[i])][:1]
                seen.append(match)
                mirrored += not torch.equal(pixels, images[match])
        assert sorted(seen) == list(range(12))
        orders.append(seen)
    assert 0 < mirrored < 36  # the random flip
    assert len({tuple(order) for order in orders + [list(range(12))]}) == 4  # shuffled, each epoch anew


def test_the_recipe_images_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    import torchvision.io
    images = data.ImageTensorDataset(data.make_shapes(12, 16))
    tmp_path = tmp_path / 'data'  # not there yet: shapes need no data folder
    bench = benchmark.BenchConfig(data_dir=str(tmp_path), image_size=16)
    folder = tmp_path / 'bench-shapes-12x16-png'
    real, written = torchvision.io.write_png, []

    def dies_after_five(image, path):
        if len(written) == 5:
            raise KeyboardInterrupt  # killed mid-way
        written.append(path)
        real(image, path)
    monkeypatch.setattr(torchvision.io, 'write_png', dies_after_five)
    with pytest.raises(KeyboardInterrupt):
        timing.image_folder_for(bench, 'shapes', images)
    assert os.listdir(tmp_path) == []  # no folder of five images, no temporary one
    monkeypatch.setattr(torchvision.io, 'write_png', real)
    (tmp_path / f'{folder.name}.tmp-999999999').mkdir()  # what a writer killed by SIGKILL leaves (a dead pid)
    assert timing.image_folder_for(bench, 'shapes', images) == str(folder)
    assert sorted(os.listdir(folder / 'images')) == [f'{i:06d}.png' for i in range(12)]
    assert os.listdir(tmp_path) == [folder.name]
    assert oct(os.stat(folder).st_mode & 0o777) == oct(0o755)  # readable by the data folder's other users


def test_two_benchmarks_on_one_data_dir_share_the_recipe_images(tmp_path, root):
    # Two real processes write the folder at once (each write slowed, so that they overlap): both
    # finish, the folder is whole, and the copy renamed second is discarded, not left behind.
    script = f"""
import sys, time
sys.path.insert(0, {root!r})
import torchvision.io, benchmark, data, timing
real = torchvision.io.write_png
torchvision.io.write_png = lambda image, path: (time.sleep(0.05), real(image, path))
bench = benchmark.BenchConfig(data_dir={str(tmp_path)!r}, image_size=16)
print(timing.image_folder_for(bench, 'shapes', data.ImageTensorDataset(data.make_shapes(12, 16))))
"""
    writers = [subprocess.Popen([sys.executable, '-c', script], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [w.communicate(timeout=300)[0].strip().splitlines()[-1] for w in writers]
    assert [w.returncode for w in writers] == [0, 0] and outputs[0] == outputs[1]
    assert os.listdir(tmp_path) == ['bench-shapes-12x16-png']
    assert len(os.listdir(os.path.join(outputs[0], 'images'))) == 12


@pytest.mark.xdist_group('campaign')  # one worker runs the campaign, once
def test_profile_and_sampling(campaign):
    profile = load(campaign, 'profile')
    assert profile['row'] == timing.start_row(benchmark.BenchConfig(), torch.device('cpu')).name
    categories = profile['categories']
    assert all(categories[name]['measured_ms'] > 0 for name in ('convolution and matmul', 'normalisation', 'attention',
                                                                 'optimizer and EMA'))
    assert profile['total']['measured_ms'] == pytest.approx(sum(c['measured_ms'] for c in categories.values()))
    assert profile['target']['slug'] == 'cpu' and profile['top_ops'][0]['ms_per_iter'] > 0
    trace = json.loads(gzip.decompress((campaign / 'profile-trace.json.gz').read_bytes()))
    assert trace['traceEvents']
    sampling = load(campaign, 'sampling')
    rows = {row['name']: row for row in sampling['sampling']}
    # --quick on a CPU; DDIM-50, DPM-Solver++ at 10, 20 and 50 calls and DDPM-1000 on a GPU.
    assert set(rows) == {'DDIM-10', 'DPM-Solver++-5', 'DPM-Solver++-10', 'DDPM-100'}
    for row in rows.values():
        assert row['img_per_s'] == pytest.approx(row['batch_size'] / row['seconds_per_batch'])
        assert row['tflops'] == pytest.approx(row['img_per_s'] * row['steps'] * sampling['flops_per_image']['forward']
                                              / 1e12)


@pytest.mark.xdist_group('campaign')  # one worker runs the campaign, once
def test_gputests_part_logs_a_training_run(campaign):
    rows = [json.loads(line) for line in (campaign / 'gputests-train-metrics.jsonl').read_text().splitlines()]
    trained = [r for r in rows[1:] if r['kind'] == 'train']
    assert rows[0]['config']['preset'] == 'tiny' and [r['step'] for r in trained] == [3, 6]
    assert all(math.isfinite(r['loss']) for r in trained) and rows[-1]['kind'] == 'done'
    assert 'skipped' in (campaign / 'gputests.log').read_text()  # tests/test_gpu.py needs CUDA


@pytest.mark.xdist_group('campaign')  # one worker runs the campaign, once
def test_quality_sweep_and_loaders(campaign):
    quality = load(campaign, 'quality')
    assert [run['seed'] for run in quality['runs']] == [0, 0, 1]
    for weights in ('model', 'ema'):
        c = quality['comparison'][weights]
        assert abs(c['all_speedups']['relative_difference']) < 0.05  # same seed and data: close
        assert c['baseline_other_seed']['relative_difference'] != 0  # another seed does move it
    sweep = load(campaign, 'sweep')
    assert [row['batch_size'] for row in sweep['rows']] == [4, 8, 16]
    loaders = load(campaign, 'loaders')
    delivered = {row['name']: row for row in loaders['loaders']}
    assert delivered['gpu (device-resident)']['img_per_s'] > 0 and loaders['step_img_per_s'] > 0
    if data.ffcv_missing_reason() is None:
        assert [row for row in loaders['loaders'] if row['name'].startswith('FFCV')][0]['img_per_s'] > 0
    assert load(campaign, 'small')['complete']


def test_a_ladder_killed_mid_way_keeps_its_finished_rows(tmp_path, root):
    out = tmp_path / 'out'
    args = [sys.executable, 'benchmark.py', '--device', 'cpu', '--preset', 'tiny', '--quick', '--out-dir', str(out),
            '--data-dir', str(tmp_path / 'data'), '--stem', 'killed']
    process = subprocess.Popen(args, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    report = out / 'killed.json'
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        if report.exists() and len(json.loads(report.read_text())['rows']) >= 2:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    result = json.loads(report.read_text())  # written by a rename: never half a file
    assert not result['complete'] and len(result['rows_planned']) == 17
    assert 2 <= len(result['rows']) < 17 and result['rows'][0]['img_per_s'] > 0
    assert '(incomplete' in (out / 'killed.md').read_text()


def test_a_part_cut_at_its_limit_keeps_its_rows_and_says_so(tmp_path, root):
    # Every part of measure_gpu.sh runs under `timeout $PART_LIMIT`: a command that must end inside
    # a fixed limit ends with the rows it finished, exit 0, and a line saying it was cut.
    # A loaded machine may finish no row in the first limit (its log then says nothing was measured,
    # also right): the limit grows until the cut falls after a row.
    for limit in (15, 40, 90):
        out = tmp_path / f'out-{limit}'
        result = subprocess.run(['bash', 'scripts/measure_gpu.sh', 'ladder', str(out), '--quick'], cwd=root,
                                env={**os.environ, 'PART_LIMIT': str(limit), 'OMP_NUM_THREADS': '1'},
                                capture_output=True, text=True, timeout=limit + 120)
        assert result.returncode == 0, result.stderr[-2000:]
        if (out / 'ladder.json').exists():
            break
        assert f'cut at {limit} s (exit 124: the time limit, or a kill): before ladder.json was written: ' \
               f'nothing measured' in (out / 'ladder.log').read_text()
    assert (f'cut at {limit} s (exit 124: the time limit, or a kill): ladder.json holds the rows finished before'
            in (out / 'ladder.log').read_text())
    ladder = load(out, 'ladder')
    assert not ladder['complete'] and 1 <= len(ladder['rows']) < len(ladder['rows_planned'])
    # A mode that writes its JSON only at the end says that nothing was measured, whatever an
    # earlier run left in the folder.
    (out / 'quality.json').write_text('{"complete": true}')
    result = subprocess.run(['bash', 'scripts/measure_gpu.sh', 'quality', str(out), '--quick'], cwd=root,
                            env={**os.environ, 'PART_LIMIT': '3', 'OMP_NUM_THREADS': '1'}, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and not (out / 'quality.json').exists()
    assert 'cut at 3 s (exit 124: the time limit, or a kill): before quality.json was written: nothing measured' in (
        out / 'quality.log').read_text()
    for bad in ('9m', '0', '2', '08'):  # timeout reads 0 as no limit; bash reads 08 as bad octal
        result = subprocess.run(['bash', 'scripts/measure_gpu.sh', 'ladder', str(out), '--quick'], cwd=root,
                                env={**os.environ, 'PART_LIMIT': bad}, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and f"PART_LIMIT must be whole seconds, at least 3, not '{bad}'" in result.stderr


def test_compile_rows_compile_the_network_or_the_whole_loss(monkeypatch):
    # 'torch.compile (the network)' compiles the UNet inside an eager loss; the next row and
    # train.py compile the whole loss in one graph. --quick on a CPU: the eager backend, unless
    # --compile-backend says otherwise.
    cpu = torch.device('cpu')
    calls = []
    monkeypatch.setattr(torch, 'compile', lambda function, **options: calls.append((function, options)) or function)
    dataset = data.ImageTensorDataset(data.make_shapes(64, 16))
    for backend, expected in (('auto', {'backend': 'eager'}), ('inductor', {})):
        bench = benchmark.resolve(benchmark.BenchConfig(device='cpu', preset='tiny', quick=True, image_size=16,
                                                        batch_size=4, big_batch=8, compile_backend=backend,
                                                        num_workers=0), cpu)
        network_row, loss_row = [r for r in timing.ladder(bench, cpu) if r.compile][:2]
        assert (network_row.compile_scope, loss_row.compile_scope) == ('model', 'loss')
        for row in (network_row, loss_row):
            cfg = timing.row_train_config(row, bench, cpu, 'shapes')
            run = timing.build_row_run(cfg, bench, cpu, dataset, compile_scope=row.compile_scope)
            function, options = calls[-1]
            if row is network_row:
                assert function is run.model and options == {'mode': None, **expected}
            else:
                assert function is run.compute_loss and options == {'fullgraph': True, 'mode': None, **expected}
            x0 = next(train.batches(run, 0))
            torch.manual_seed(0)
            loss = run.compute_loss(x0)
            torch.manual_seed(0)
            assert torch.equal(loss, diffusion.training_loss(run.model, run.sched, x0))


def test_every_mode_builds_a_row_with_its_compile_scope(tmp_path, monkeypatch):
    # The network-only compile row must reach build_row_run as such from the ladder, the quality
    # check and the profile (else it would silently time the whole-loss graph).
    scopes = []

    def spy(row_cfg, bench, device, dataset, make_model=None, compile_scope='loss'):
        scopes.append(compile_scope)
        raise RuntimeError('stop here')
    for module in (timing, benchmark):  # the ladder's rows, and the quality check's and the profile's
        monkeypatch.setattr(module, 'build_row_run', spy)
    cpu = torch.device('cpu')
    bench = benchmark.BenchConfig(device='cpu', preset='tiny', quick=True, image_size=16, batch_size=4, big_batch=8,
                                  data_dir=str(tmp_path), from_row='the network')
    dataset = data.ImageTensorDataset(data.make_shapes(64, 16))
    row = timing.start_row(bench, cpu)
    assert row.compile_scope == 'model'
    assert 'stop here' in timing.measure_row(row, bench, cpu, dataset, 'shapes', {})['failed']
    with pytest.raises(RuntimeError, match='stop here'):
        benchmark.train_for_quality(row, bench, cpu, dataset, 'shapes', 0)
    with pytest.raises(RuntimeError, match='stop here'):
        benchmark.run_roofline(dataclasses.replace(bench, profile=True))
    assert scopes == ['model'] * 3


def test_a_failing_row_is_reported_and_the_run_goes_on(tmp_path, monkeypatch):
    real = timing.build_row_run

    def broken_on_batch_8(row_cfg, *args, **kwargs):
        if row_cfg.batch_size == 8:
            raise RuntimeError('inductor: something went wrong\n' + 'x' * 1000)
        return real(row_cfg, *args, **kwargs)
    monkeypatch.setattr(timing, 'build_row_run', broken_on_batch_8)
    result = benchmark.main(['--device', 'cpu', '--preset', 'tiny', '--quick', '--out-dir', str(tmp_path),
                             '--data-dir', str(tmp_path / 'data'), '--rows', 'Baseline,Scale up', '--no-peer',
                             '--no-sampling', '--batch-size', '4', '--big-batch', '8'])
    baseline, failed = result['rows']
    assert baseline['img_per_s'] > 0
    assert failed['failed'].startswith('RuntimeError: inductor: something went wrong') and len(failed['failed']) <= 300
    assert 'FAILED: RuntimeError' in (tmp_path / 'cpu-tiny.md').read_text()


def test_start_row_of_the_other_modes():
    cpu = torch.device('cpu')
    assert timing.start_row(benchmark.BenchConfig(), cpu).name.startswith('Device-resident data')
    assert timing.start_row(benchmark.BenchConfig(from_row='sdpa'), cpu).name == 'PyTorch SDPA'
    with pytest.raises(benchmark.ConfigError, match='matches no row'):
        timing.start_row(benchmark.BenchConfig(from_row='warp drive'), cpu)


def test_the_layout_sweep_alternates_the_memory_format_alone():
    cpu, bench = torch.device('cpu'), benchmark.BenchConfig()
    best = timing.start_row(bench, cpu)
    rows = timing.sweep_rows('layout', best, bench, cpu)
    assert [(r.name, r.channels_last) for r in rows] == [('NCHW', False), ('channels-last', True),
                                                         ('NCHW again', False), ('channels-last again', True)]
    assert all(dataclasses.replace(r, name=best.name, channels_last=best.channels_last) == best for r in rows)
    assert not best.channels_last and not train.resolve_defaults(train.TrainConfig(amp='off'),
                                                                   torch.device('cuda')).channels_last


def test_categories():
    assert roofline.categorise('sm90_xmma_fprop_implicit_gemm_bf16') == 'conv / matmul'
    assert roofline.categorise('aten::native_group_norm_backward') == 'norm'
    assert roofline.categorise('pytorch_flash::flash_fwd_kernel') == 'attention'
    assert roofline.categorise('aten::_softmax') == roofline.categorise('cunn_SoftMaxForward<4>') == 'attention'
    assert roofline.categorise('aten::normal_') == 'elementwise'  # the noise draw, not a normalisation
    assert roofline.categorise('void at::native::multi_tensor_apply_kernel<FusedAdam>') == 'optimizer'
    assert roofline.categorise('triton_poi_fused_add_mul_0') == 'elementwise'


def test_mfu_uses_the_row_precision_and_overrides():
    bench = benchmark.BenchConfig(peak_tflops=100.0, peak_tflops_fp32=10.0)
    cpu = torch.device('cpu')
    assert timing.peak_for('bf16', cpu, bench) == 100.0
    assert timing.peak_for('tf32', cpu, bench) == 10.0
    assert timing.peak_for('bf16', cpu, benchmark.BenchConfig()) is None
    flops = {'train': 1e9, 'torchinfo_train': 0.9e9}
    row_cfg = benchmark.train.TrainConfig(batch_size=100, amp='bf16')
    described = timing.throughput({'ms_per_iter': 10.0, 'peak_mem_gb': None}, row_cfg, bench, cpu, flops)
    assert described['img_per_s'] == pytest.approx(10_000)
    assert described['tflops'] == pytest.approx(10.0)
    assert described['mfu'] == pytest.approx(0.1)
    assert described['mfu_a100'] == pytest.approx(10.0 / 312)
    fp32 = timing.throughput({'ms_per_iter': 10.0, 'peak_mem_gb': None},
                              benchmark.train.TrainConfig(batch_size=100, amp='off'), bench, cpu, flops)
    assert fp32['precision'] == 'fp32' and fp32['mfu_a100'] == pytest.approx(10.0 / 19.5)
    assert devices.A100_PEAK_TFLOPS['tf32'] == 156.0  # a TF32 row is held against the TF32 peak


@pytest.mark.parametrize('extra, expected', [
    (['--preset', 'huge'], 'invalid choice'),
    (['--device', 'tpu'], 'unknown device'),
    (['--iters', '0'], '--iters must be at least 1'),
    (['--batch-size', '-1'], '--batch-size must be at least 1'),
    (['--rows', 'warp drive'], 'matches no row'),
    (['--from-row', 'warp drive', '--profile'], 'matches no row'),
    (['--dataset', 'cifar10'], 'CIFAR-10 not found'),
    (['--profile', '--quality'], 'choose one mode'),
    (['--image-size', '18'], 'cannot be halved'),
    (['--stem', 'a/b'], 'a plain file name'),
    (['--stem', '../../x'], 'a plain file name'),
    (['--seed', '-1'], '--seed must be in [0, 4294967295]'),
    (['--peak-tflops', '0'], '--peak-tflops must be a positive number'),
    (['--sweep-values', '4'], '--sweep-values is not read by the ladder (no mode flag); it is read only by --sweep'),
    (['--sweep', 'layout', '--sweep-values', '4,8'], '--sweep-values is not read by --sweep layout'),  # fixed points
    (['--steps', '5', '--profile'], '--steps is not read by --profile on a CPU; it is read only by --quality'),
    (['--gpu', 'h200'], '--gpu is not read by the ladder (no mode flag); it is read only by --roofline, --profile'),
    # a mode refuses every flag it does not read (MODE_READS), not only a hand-picked few
    (['--roofline', '--rows', 'Baseline'], '--rows is not read by --roofline'),
    (['--roofline', '--iters', '3'], '--iters is not read by --roofline'),
    (['--roofline', '--sample-batch', '4'], '--sample-batch is not read by --roofline'),
    (['--roofline', '--no-peer'], '--no-peer is not read by --roofline'),
    (['--roofline', '--profile', '--bandwidth-gbs', '100'], '--bandwidth-gbs is not read by --profile on a CPU'),
    (['--roofline', '--profile', '--peak-tflops', '100'], '--peak-tflops is not read by --profile on a CPU'),
    (['--sampling-only', '--from-row', 'Baseline', '--steps', '3'], '--steps is not read by --sampling-only'),
    (['--rows', 'Baseline,Chanels-last'], "'Chanels-last' matches no row"),
    (['--side-by-side', '--gpu', 'h200'], '--gpu is not read by --side-by-side on a CPU'),
    (['--side-by-side', '--rows', 'Baseline'], '--rows is not read by --side-by-side on a CPU'),
    (['--side-by-side', '--sweep', 'peer'], 'choose one mode'),
])
def test_bad_flags_are_one_line_and_write_nothing(tmp_path, capsys, extra, expected):
    args = ['--device', 'cpu', '--preset', 'tiny', '--quick', '--out-dir', str(tmp_path / 'out'),
            '--data-dir', str(tmp_path / 'data'), *extra]
    code, err = refusal(capsys, benchmark.cli, args)
    assert code == 2 and expected in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / 'out').exists() or not list((tmp_path / 'out').iterdir())


@pytest.mark.parametrize('args, expected', [
    ([], 'usage: bash scripts/measure_gpu.sh step|knobs|headline|profile|'), (['headline'], 'usage:'),
    (['bogus', 'OUT'], 'usage:'),
    (['headline', 'OUT', '--fast'], 'usage:'), (['headline', 'OUT', '--quick', 'extra'], 'usage:'),
    (['headline', '', '--quick'], 'must be a folder'), (['headline', 'FILE', '--quick'], 'must be a folder'),
    (['headline', 'FILE/sub', '--quick'], 'cannot write there')])
def test_measure_script_refuses_bad_calls_in_one_line_and_writes_nothing(tmp_path, root, args, expected):
    (tmp_path / 'file').write_text('not a folder')
    args = [{'OUT': str(tmp_path / 'out'), 'FILE': str(tmp_path / 'file'),
             'FILE/sub': str(tmp_path / 'file' / 'sub')}.get(a, a) for a in args]
    result = subprocess.run(['bash', 'scripts/measure_gpu.sh', *args], cwd=root, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and expected in result.stderr and len(result.stderr.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ['file']


def test_measure_script_refuses_missing_wheels(tmp_path, root):
    if os.path.isdir(os.path.join(root, '.whl')):
        pytest.skip('.whl/ is present here')
    result = subprocess.run(['bash', 'scripts/measure_gpu.sh', 'headline', str(tmp_path)], cwd=root,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and 'diffusers==0.42.1' in result.stderr
    assert not list(tmp_path.iterdir())


def test_measure_script_finds_no_gpu_before_installing_or_writing_anything(tmp_path, root):
    # With the wheels at hand (stand-ins: empty files) and no GPU, the script stops at the device check:
    # nothing installed (pip would fail on these files), no OUT_DIR made.
    if __import__('torch').cuda.is_available():
        pytest.skip('a GPU is here')
    (tmp_path / '.whl').mkdir()
    for wheel in ('diffusers-0.42.1', 'torchinfo-1.8.0', 'torch_fidelity-0.4.0'):
        (tmp_path / '.whl' / f'{wheel}-py3-none-any.whl').write_bytes(b'')
    result = subprocess.run(['bash', os.path.join(root, 'scripts', 'measure_gpu.sh'), 'headline', 'out'],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and 'no CUDA device' in result.stderr, result.stderr[-2000:]
    assert len(result.stderr.splitlines()) == 1 and sorted(p.name for p in tmp_path.iterdir()) == ['.whl']


def test_a_run_without_flags_plans_what_the_device_can_time(tmp_path, capsys):
    cpu, gpu = (benchmark.resolve(benchmark.BenchConfig(), torch.device(kind)) for kind in ('cpu', 'cuda'))
    assert (cpu.preset, cpu.warmup, cpu.iters, cpu.sample_batch, cpu.precision) == ('tiny', 3, 10, 64, 'bf16')
    assert benchmark.resolve(benchmark.BenchConfig(profile=True), torch.device('cpu')).precision == 'fp32'
    assert (gpu.preset, gpu.warmup, gpu.iters, gpu.sample_batch, gpu.precision) == ('ddpm-cifar10', 10, 50, 1000,
                                                                                     'bf16')
    given = benchmark.resolve(benchmark.BenchConfig(preset='small', iters=7, warmup=0), torch.device('cpu'))
    assert (given.preset, given.iters, given.warmup) == ('small', 7, 0)  # a flag given wins
    benchmark.main(['--device', 'cpu', '--quick', '--rows', 'Baseline', '--no-peer', '--no-sampling',
                    '--data-dir', str(tmp_path / 'data'), '--out-dir', str(tmp_path)])
    out = capsys.readouterr().out
    assert out.startswith('ladder: 1 rows of tiny at 16x16 on CPU') and 'iterations' in out


def test_cpu_runs_stay_out_of_the_committed_results(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert benchmark.validate(benchmark.BenchConfig(device='cpu')).out_dir == 'runs/benchmark'
