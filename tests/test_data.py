import pytest
import torch
import torchvision
from helpers import write_cifar10, write_image_folder

import data
import loaders


def test_shapes_deterministic_and_structured():
    a = data.make_shapes(40, 16, seed=0)
    assert a.shape == (40, 3, 16, 16) and a.dtype == torch.uint8
    assert torch.equal(a, data.make_shapes(40, 16, seed=0))
    assert torch.equal(a[:10], data.make_shapes(10, 16, seed=0))  # a larger count extends a smaller
    assert not torch.equal(a, data.make_shapes(40, 16, seed=1))
    # Real structure: neighbouring pixels are far more alike than random pixels.
    x = a.float()
    neighbour = (x[..., 1:] - x[..., :-1]).abs().mean()
    shuffled = (x.flatten()[torch.randperm(x.numel())] - x.flatten()).abs().mean()
    assert neighbour < shuffled / 3
    assert data.make_shapes(3, 64).shape == (3, 3, 64, 64)


def test_epoch_order_depends_on_seed_and_epoch_only():
    p0, f0 = loaders.epoch_order(10_000, seed=3, epoch=0)
    p0b, f0b = loaders.epoch_order(10_000, seed=3, epoch=0)
    p1, f1 = loaders.epoch_order(10_000, seed=3, epoch=1)
    q0, _ = loaders.epoch_order(10_000, seed=4, epoch=0)
    assert torch.equal(p0, p0b) and torch.equal(f0, f0b)
    assert sorted(p0.tolist()) == list(range(10_000))  # every image once per epoch
    # Each epoch and each seed its own order: few images keep their place.
    for other in (p1, q0):
        assert (p0 == other).sum() < 10
    # About half the images flipped (binomial: 5000 +- 50), independently between epochs.
    assert abs(f0.sum().item() - 5000) < 250 and abs(f1.sum().item() - 5000) < 250
    assert abs((f0 == f1).sum().item() - 5000) < 250


def test_loader_epochs_differ_and_cover_the_set():
    images = torch.arange(64, dtype=torch.uint8).view(64, 1, 1, 1).expand(64, 3, 2, 2).contiguous()
    loader = loaders.GPULoader(images, 8, seed=0, device='cpu')
    seen = []
    for epoch in range(2):
        batches = torch.cat(list(loader.epoch(epoch)))
        seen.append(((batches[:, 0, 0, 0] + 1) * 127.5).round().long())  # back to the image index
    assert sorted(seen[0].tolist()) == list(range(64)) == sorted(seen[1].tolist())
    assert not torch.equal(seen[0], seen[1])


def test_gpu_and_torch_loaders_yield_the_same_batches():
    images = data.make_shapes(50, 8)
    dataset = data.ImageTensorDataset(images)
    gpu = loaders.GPULoader(images, 8, seed=0, device='cpu')
    torch_loader = loaders.TorchLoader(dataset, 8, seed=0, device='cpu', num_workers=0)
    assert gpu.batches_per_epoch == torch_loader.batches_per_epoch == 6  # drop-last
    for epoch, start in [(0, 0), (1, 4)]:
        a, b = list(gpu.epoch(epoch, start)), list(torch_loader.epoch(epoch, start))
        assert len(a) == len(b) == 6 - start
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
            assert x.dtype == torch.float32 and x.shape == (8, 3, 8, 8)
            assert x.min() >= -1 and x.max() <= 1


def test_loader_flips_and_scales_as_epoch_order_says():
    images = data.make_shapes(16, 8)
    loader = loaders.GPULoader(images, 16, seed=5, device='cpu')
    (batch,) = list(loader.epoch(2))
    permutation, flips = loaders.epoch_order(16, 5, 2)
    expected = images[permutation].float() / 127.5 - 1
    expected[flips] = expected[flips].flip(-1)
    assert torch.equal(batch, expected)
    assert flips.any() and not flips.all()  # the test sees both cases


def test_resumed_epoch_continues_the_same_order():
    loader = loaders.GPULoader(data.make_shapes(40, 8), 4, seed=0, device='cpu')
    full = list(loader.epoch(0))
    assert all(torch.equal(a, b) for a, b in zip(full[3:], loader.epoch(0, start=3), strict=True))


def test_torch_loader_with_workers():
    dataset = data.ImageTensorDataset(data.make_shapes(24, 8))
    loader = loaders.TorchLoader(dataset, 4, seed=0, device='cpu', num_workers=2)
    reference = loaders.GPULoader(dataset.images, 4, seed=0, device='cpu')
    for epoch in range(2):  # persistent workers across epochs
        assert all(torch.equal(a, b) for a, b in zip(loader.epoch(epoch), reference.epoch(epoch), strict=True))


def test_ranks_get_disjoint_shards_of_equal_length():
    n, batch = 37, 4
    seen = []
    for rank in range(2):
        loader = loaders.Loader(n, batch, seed=0, rank=rank, world_size=2)
        indices, _ = loader.shard(0)
        assert len(indices) == loader.batches_per_epoch * batch == 16
        seen.append(set(indices.tolist()))
    assert not seen[0] & seen[1]


def test_batch_larger_than_data_set_is_an_error():
    with pytest.raises(data.DataError, match='larger than the data set'):
        loaders.Loader(10, 11, seed=0)


def test_image_folder_converts_modes_and_sizes(tmp_path):
    write_image_folder(tmp_path, count=12)
    dataset = data.load_dataset('folder', str(tmp_path), 16)
    assert len(dataset) == 12  # recursive, PNG and JPEG
    for i in range(len(dataset)):
        image = dataset[i]
        assert image.shape == (3, 16, 16) and image.dtype == torch.uint8
    assert dataset.to_tensor(progress=False).shape == (12, 3, 16, 16)


def test_image_folder_errors_name_the_file(tmp_path):
    with pytest.raises(data.DataError, match='does not exist'):
        data.load_dataset('folder', str(tmp_path / 'missing'), 16)
    (tmp_path / 'empty').mkdir()
    with pytest.raises(data.DataError, match='no PNG or JPEG'):
        data.load_dataset('folder', str(tmp_path / 'empty'), 16)
    write_image_folder(tmp_path / 'bad', count=3)
    (tmp_path / 'bad' / 'notes.png').write_text('not an image')
    with pytest.raises(data.DataError, match='notes.png'):
        data.load_dataset('folder', str(tmp_path / 'bad'), 16)


def test_worker_processes_decode_the_same_images_and_find_the_first_broken_file(tmp_path, monkeypatch):
    write_image_folder(tmp_path / 'ok', count=12)
    dataset = data.ImageFolderDataset(str(tmp_path / 'ok'), 16)
    one_process = dataset.to_tensor(progress=False)
    monkeypatch.setattr(data, 'PARALLEL_FROM', 1)  # large-set path on a small set
    assert torch.equal(dataset.to_tensor(progress=False), one_process)
    assert torch.equal(one_process[5], dataset[5])  # in file order
    write_image_folder(tmp_path / 'bad', count=12)
    for name in ('part1/img7.png', 'part2/img8.png'):
        (tmp_path / 'bad' / name).write_text('not an image')
    with pytest.raises(data.DataError, match='img7.png'):  # the first broken file in sorted order
        data.load_dataset('folder', str(tmp_path / 'bad'), 16)


def test_truncated_image_is_reported_when_decoded(tmp_path):
    write_image_folder(tmp_path, count=2)
    path = next(tmp_path.rglob('*.png'))
    path.write_bytes(path.read_bytes()[:60])  # header intact, pixel data cut off
    dataset = data.ImageFolderDataset(str(tmp_path), 16)
    with pytest.raises(data.DataError, match=path.name):
        dataset.to_tensor(progress=False)


@pytest.fixture
def fake_cifar_checksums(monkeypatch):
    # torchvision checks the real files' MD5 sums; the test's own files have others.
    monkeypatch.setattr(torchvision.datasets.cifar, 'check_integrity', lambda *args, **kwargs: True)


def test_cifar10_from_the_real_on_disk_format(tmp_path, fake_cifar_checksums):
    import pickle
    write_cifar10(tmp_path, train_per_batch=6, test_count=5)
    train = data.load_dataset('cifar10', str(tmp_path), 32)
    assert len(train) == 30 and train[0].shape == (3, 32, 32)
    with open(tmp_path / 'cifar-10-batches-py' / 'data_batch_1', 'rb') as f:
        row = pickle.load(f)['data'][0]
    # The channel-planar row becomes a (3, 32, 32) image: red plane first.
    assert torch.equal(train[0], torch.from_numpy(row).reshape(3, 32, 32))
    assert data.load_heldout('cifar10', str(tmp_path), 32, 4).shape == (4, 3, 32, 32)
    assert data.load_dataset('cifar10', str(tmp_path), 16)[0].shape == (3, 16, 16)


def test_cifar10_offline_without_a_copy_says_what_to_do(tmp_path, monkeypatch):
    def no_network(*args, **kwargs):
        raise OSError('[Errno -3] Temporary failure in name resolution')
    monkeypatch.setattr(torchvision.datasets.cifar, 'download_and_extract_archive', no_network)
    with pytest.raises(data.DataError) as error:
        data.load_dataset('cifar10', str(tmp_path), 32)
    message = str(error.value)
    assert 'download failed' in message and '--dataset shapes' in message and '--data-dir' in message
    assert '--dataset digits' in message  # the real images that need no download


def test_choose_loader():
    dataset = data.ImageTensorDataset(data.make_shapes(4, 8))
    assert loaders.choose_loader('torch', len(dataset) * dataset[0].numel(), 'cpu') == 'torch'
    assert loaders.choose_loader('auto', len(dataset) * dataset[0].numel(), 'cpu') == 'gpu'  # tiny set: device-resident


def test_sixteen_bit_grayscale_keeps_its_levels(tmp_path):
    import numpy as np
    from PIL import Image
    ramp = np.linspace(0, 65535, 32 * 32).reshape(32, 32).astype(np.uint16)
    Image.fromarray(ramp).save(tmp_path / 'deep.png')
    with Image.open(tmp_path / 'deep.png') as image:
        assert image.mode == 'I;16'  # what PIL makes of it; its convert('RGB') would clip to white
    (image,) = data.ImageFolderDataset(str(tmp_path), 32)
    expected = torch.from_numpy(np.round(ramp / 257.0).astype(np.uint8))
    assert all(torch.equal(image[c], expected) for c in range(3))
    assert 120 < image.float().mean() < 135  # mid-grey on average, as the ramp is


def test_every_image_is_decoded_before_training(tmp_path):
    import numpy as np
    from PIL import Image
    write_image_folder(tmp_path, count=6)
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(noise).save(tmp_path / 'zz-cut.jpg', quality=95)
    whole = (tmp_path / 'zz-cut.jpg').read_bytes()
    (tmp_path / 'zz-cut.jpg').write_bytes(whole[:len(whole) // 2])
    Image.fromarray(noise).save(tmp_path / 'aa-cut.png')
    whole = (tmp_path / 'aa-cut.png').read_bytes()
    (tmp_path / 'aa-cut.png').write_bytes(whole[:len(whole) - 200])
    with pytest.raises(data.DataError, match='aa-cut.png'):  # the first broken one in sorted order
        data.load_dataset('folder', str(tmp_path), 16)
    (tmp_path / 'aa-cut.png').unlink()
    with pytest.raises(data.DataError, match='zz-cut.jpg'):
        data.load_dataset('folder', str(tmp_path), 16)


def test_fingerprint_tells_data_sets_apart():
    a = data.ImageTensorDataset(data.make_shapes(100, 8, seed=0))
    assert data.fingerprint(a) == data.fingerprint(data.ImageTensorDataset(data.make_shapes(100, 8, seed=0)))
    assert data.fingerprint(a) != data.fingerprint(data.ImageTensorDataset(data.make_shapes(100, 8, seed=1)))
    assert data.fingerprint(a) != data.fingerprint(data.ImageTensorDataset(data.make_shapes(101, 8, seed=0)))


def test_folder_crops_the_centre_and_finds_upper_case_extensions(tmp_path):
    import numpy as np
    from PIL import Image
    wide = np.zeros((16, 48, 3), dtype=np.uint8)
    wide[:, :16] = (255, 0, 0)      # left third red
    wide[:, 16:32] = (0, 255, 0)    # middle green
    wide[:, 32:] = (0, 0, 255)      # right blue
    Image.fromarray(wide).save(tmp_path / 'WIDE.PNG')
    (image,) = data.ImageFolderDataset(str(tmp_path), 16)  # shorter side already 16: only the crop acts
    assert torch.equal(image, torch.tensor([0, 255, 0], dtype=torch.uint8).view(3, 1, 1).expand(3, 16, 16))


def test_downscaling_averages_instead_of_picking_pixels():
    stripes = torch.zeros(1, 3, 32, 32, dtype=torch.uint8)
    stripes[..., ::2] = 255  # one-pixel columns: any point sampling gives 0 or 255
    small = data.resize_images(stripes, 16)
    assert small.shape == (1, 3, 16, 16) and (small.float() - 127.5).abs().max() < 20


def test_heldout_sets_are_not_training_images(tmp_path, fake_cifar_checksums):
    train = data.make_shapes(64, 16, seed=0)
    heldout = data.load_heldout('shapes', '', 16, 64)
    assert not any(torch.equal(h, t) for h in heldout for t in train)
    write_cifar10(tmp_path, train_per_batch=6, test_count=5)
    import pickle
    with open(tmp_path / 'cifar-10-batches-py' / 'test_batch', 'rb') as f:
        test_rows = pickle.load(f)['data']
    expected = torch.from_numpy(test_rows[:4]).reshape(4, 3, 32, 32)
    assert torch.equal(data.load_heldout('cifar10', str(tmp_path), 32, 4), expected)  # the test split
