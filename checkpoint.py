"""Our checkpoint files: the one format of train.py, sample.py and benchmark.py, written atomically
and read with every check (a damaged file, another network, NaN weights), and the resume policy:
which settings a resumed run replays, which must match, which may change with a warning."""
import hashlib
import json
import math
import os
import sys
import zipfile
from dataclasses import asdict, fields, replace

import torch

import evaluation
from bookkeeping import (Run, any_rank, gather_to_rank0, last_good_note, load_states, rng_states, set_rng_states,
                         weights_finite)
from cli import ConfigError, NonFiniteLoss, brief
from devices import own_rng
from diffusers_io import STUDENT_FILE, diffusers_scheduler, read_diffusers
from files import atomic_open, disk_full_error
from model import MODEL_VERSION, UNet, UNetConfig

# The one checkpoint format, of train.py, sample.py and benchmark.py: a dict that loads with
# torch.load(weights_only=True) and holds plain state dicts 'model' and 'ema', the run's
# 'config' and 'model_config' (as dicts), 'model_version', and what an exact resume needs:
# 'optimizer', 'scaler', 'step', 'epoch', 'batch_in_epoch', 'rng' (one entry per rank), 'data'
# (image count and fingerprint), 'train_seconds' and 'eval_owed'. checkpoint_state
# below writes it, restore reads it back. distill.py's students add a 'student' record (steps, grid,
# prediction: what sample.py draws them with); read_checkpoint refuses them wherever a teacher is read.
CHECKPOINT_REQUIRED = ('model', 'ema', 'config', 'model_config')
RESUME_REQUIRED = ('optimizer', 'scaler', 'step', 'epoch', 'batch_in_epoch', 'rng')  # and an exact resume these
# The resume rule. A resumed run replays the settings given to the run (its 'flags'), with those
# given at the resume on top, except where it resumes from and where its files go (by default
# the checkpoint's folder). Given with another value: refused (an exact resume needs them), or
# applied with a warning (the run then differs from an uninterrupted one), or applied (the rest:
# length, logging, outputs, speed). Settings that 'auto' resolves per device are resolved again.
NOT_REPLAYED = ('resume', 'out_dir')
RESUME_MUST_MATCH = ('preset', 'dataset', 'image_size', 'shapes_count', 'batch_size', 'seed', 'schedule', 'dropout',
                     'prediction', 'class_cond', 'label_drop')
CHANGED_WITH_WARNING = ('lr', 'warmup', 'grad_clip', 'ema_decay', 'amp', 'loss_weight', 'snr_gamma',
                        'channels_last',  # the layout: another order of the noise's draws and of the sums
                        't_sampling', 't_mean', 't_scale', 't_reweight', 'input_perturbation', 'lr_decay',
                        'adam_beta2', 'ema_length', 'immiscible', 'guidance')
# What a checkpoint written before a setting existed trained with.
SETTINGS_BEFORE_THEY_EXISTED = {'prediction': 'eps', 'loss_weight': 'uniform', 'snr_gamma': None,
                                't_sampling': 'uniform', 't_mean': None, 't_scale': None, 't_reweight': False,
                                'input_perturbation': 0.0, 'lr_decay': 'none', 'adam_beta2': 0.999,
                                'ema_length': 0.0, 'immiscible': False, 'class_cond': False, 'label_drop': None,
                                'guidance': None}
RESOLVED_PER_DEVICE = ('amp', 'compile', 'channels_last', 'fused_adam', 'loader')


def resume_path(resume: str, out_dir: str) -> str:
    """What train.py --resume means: 'auto' is OUT_DIR/ckpt.pt when it exists and a fresh run
    otherwise. A fresh run never overwrites a checkpoint (nor appends to another run's
    metrics.jsonl), and a run is never resumed into another run's folder."""
    ckpt_path = os.path.join(out_dir, 'ckpt.pt')
    if resume == 'auto':
        return ckpt_path if os.path.isfile(ckpt_path) else ''
    if not resume and os.path.isfile(ckpt_path):
        raise ConfigError(f'{ckpt_path} exists: continue that run with --resume {ckpt_path} (or --resume auto), '
                          f'or pass another --out-dir')
    if resume and os.path.isfile(resume) and not zipfile.is_zipfile(resume):
        raise ConfigError(f'--resume {resume}: not a train.py checkpoint (not a file written by torch.save)')
    if resume and os.path.isfile(resume) and os.path.isfile(ckpt_path) and not os.path.samefile(resume, ckpt_path):
        raise ConfigError(f'--resume {resume} into --out-dir {out_dir}, which holds {ckpt_path} (another run\'s, '
                          f'or a later one of this run) that the resumed run would overwrite: pass another --out-dir')
    return resume


def resume_settings(cfg, given: set) -> tuple:
    """(config, flags, checkpoint or None) of train.py's config `cfg` whose fields `given` were
    set on the command line. A resumed run replays the checkpoint's flags with the given ones on
    top, so `train.py --resume PATH` alone continues the run as it was, in PATH's folder; `flags`
    is what the next checkpoint saves for the next resume."""
    if cfg.resume not in ('', 'auto') and 'out_dir' not in given:
        cfg = replace(cfg, out_dir=os.path.dirname(cfg.resume) or '.')
    cfg = replace(cfg, resume=resume_path(cfg.resume, cfg.out_dir))
    now = {name: getattr(cfg, name) for name in sorted(given) if name not in NOT_REPLAYED}
    if not cfg.resume:
        return cfg, now, None
    ckpt = read_checkpoint(cfg.resume, f'--resume {cfg.resume}')
    saved = ckpt.get('flags')
    if saved is None:  # a checkpoint from before flags were saved: its settings, less those resolved per device
        saved = {k: v for k, v in ckpt['config'].items() if k not in NOT_REPLAYED + RESOLVED_PER_DEVICE}
    saved = dict(saved)
    if 'epochs' in given and 'steps' not in given:
        saved.pop('steps', None)  # --epochs given now sets the length; a replayed --steps would win over it
    if 'loss_weight' in given and 'snr_gamma' not in given:
        saved.pop('snr_gamma', None)  # the saved gamma belongs to the saved weighting, not to the one given now
    if 't_sampling' in given and cfg.t_sampling != saved.get('t_sampling', 'uniform'):
        for name in ('t_mean', 't_scale') + (('t_reweight',) if cfg.t_sampling == 'uniform' else ()):
            if name not in given:  # the saved law's parameters belong to it, not to the law given now
                saved.pop(name, None)
    moved = os.path.realpath(str(ckpt['config'].get('out_dir'))) != os.path.realpath(cfg.out_dir)
    if moved and 'samples_dir' not in given:  # a copy resumed elsewhere keeps its grids in its own folder
        saved['samples_dir'] = os.path.join(cfg.out_dir, 'samples')
    flags = {k: v for k, v in {**saved, **now}.items() if k in {f.name for f in fields(cfg)}}
    return type(cfg)(**flags, resume=cfg.resume, out_dir=cfg.out_dir), flags, ckpt


def warn_of_changes(ckpt: dict, cfg):
    """A warning for each CHANGED_WITH_WARNING setting of the resumed run (resolved) that
    differs from the checkpoint's."""
    for name in CHANGED_WITH_WARNING:
        theirs = ckpt['config'].get(name, SETTINGS_BEFORE_THEY_EXISTED.get(name))
        if name == 'snr_gamma' and cfg.loss_weight != 'min-snr':
            continue  # weighs nothing now: the change of --loss-weight is the warning
        if theirs != getattr(cfg, name):
            print(f"warning: --{name.replace('_', '-')} {getattr(cfg, name)} (the checkpoint's: {theirs}): the resumed "
                  f"run trains on with it, and will differ from an uninterrupted one", file=sys.stderr)
    length = ('steps', 'epochs')  # --lr-decay ends at the planned last step: another length, another schedule
    planned = tuple(ckpt['config'].get(k) for k in length)
    if cfg.lr_decay != 'none' and planned != tuple(getattr(cfg, k) for k in length):
        print(f"warning: --lr-decay {cfg.lr_decay} now decays to --steps {cfg.steps} / --epochs {cfg.epochs} (the "
              f"checkpoint's run planned {ckpt['config'].get('steps')} / {ckpt['config'].get('epochs')}): the resumed "
              f"run will differ from an uninterrupted one", file=sys.stderr)


def already_done(ckpt: dict, cfg) -> dict | None:
    """If the checkpoint holds the run's last step (--steps, or --epochs whole epochs), says so
    and returns the result of a run with nothing left to do; else None (also when an evaluation
    cut short by a stop is owed: the resumed run runs it)."""
    if ((ckpt['step'] < cfg.steps) if cfg.steps else (ckpt['epoch'] < cfg.epochs)) or (
            ckpt.get('eval_owed') and cfg.eval_every):
        return None
    target = f'--steps {cfg.steps}' if cfg.steps else f'--epochs {cfg.epochs}'
    past = ckpt['step'] > cfg.steps if cfg.steps else (ckpt['epoch'], ckpt['batch_in_epoch']) > (cfg.epochs, 0)
    print(f"{cfg.resume} holds step {ckpt['step']} (epoch {ckpt['epoch']}, batch {ckpt['batch_in_epoch']}), "
          f"{'past' if past else 'at'} the target {target}: nothing to train. Raise {target.split()[0]} to "
          f"train on.", flush=True)
    return {'step': ckpt['step'], 'stopped': None, 'last': {}, 'checkpoint': cfg.resume, 'already_done': True}


def save_checkpoint(state: dict, path: str):
    """torch.save through a temporary file and a rename: a crash mid-write leaves the previous
    checkpoint whole, and a failed write (a full disk) leaves no partial file and is an OSError
    naming the path and the free space (torch's writer reports it as a RuntimeError, the flush
    before the rename as a bare OSError)."""
    try:
        with atomic_open(path, 'wb') as f:
            torch.save(state, f)
    except (RuntimeError, OSError) as error:
        raise disk_full_error(path, error) from None


def read_checkpoint(path: str, named_as: str, student_ok: bool = False) -> dict:
    """A checkpoint, loaded without running code from the file. Anything else (no file, junk, a
    dict of something else, a checkpoint of the network before it was made the paper's) is a
    one-line ConfigError starting with `named_as` (such as '--resume PATH'); so is a distill.py
    student (its 'student' record) unless `student_ok`: it learnt a few steps on its own grid, and
    neither trains on as a train.py run nor samples with another sampler."""
    if not os.path.isfile(path):
        raise ConfigError(f'{named_as}: no such checkpoint')
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive
        raise ConfigError(f'{named_as}: not a train.py checkpoint (not a file written by torch.save)')
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as error:
        raise ConfigError(f'{named_as}: not a train.py checkpoint (cannot load it: {brief(error)})') from None
    if not isinstance(ckpt, dict) or not set(CHECKPOINT_REQUIRED) <= set(ckpt):
        raise ConfigError(f'{named_as}: not a train.py checkpoint (it lacks the model, EMA or config)')
    # Version 1 (no SiLU before the timestep projections, symmetric downsampling padding,
    # GroupNorm eps 1e-5) has the same tensors but computes another function.
    version = ckpt.get('model_version', 1)
    if version != MODEL_VERSION:
        raise ConfigError(f'{named_as}: written for UNet version {version}, and model.py is version {MODEL_VERSION} '
                          f'(the paper\'s network); its weights do not compute the same function, so retrain')
    if 'student' in ckpt and not student_ok:
        raise ConfigError(f"{named_as}: a {ckpt['student'].get('steps')}-step student of distill.py, not a train.py "
                          f"checkpoint: draw it with sample.py --ckpt {path}; a stopped distillation continues with "
                          f"distill.py --resume OUT/distill.pt")
    return ckpt


def read_student_record(path: str) -> dict | None:
    """The 'student' record of a distill.py checkpoint (its steps, grid and prediction) or of its
    diffusers export (STUDENT_FILE), or None for anything else: a train.py checkpoint, another diffusers
    folder, a file that read_checkpoint refuses."""
    if os.path.isdir(path):
        try:
            with open(os.path.join(path, STUDENT_FILE)) as f:
                record = json.load(f)
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and isinstance(record.get('steps'), int) else None
    if not os.path.isfile(path) or not zipfile.is_zipfile(path):
        return None
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True, mmap=True)  # mapped: no weights read
    except Exception:
        return None
    return ckpt.get('student') if isinstance(ckpt, dict) else None


def weights_fingerprint(state_dict: dict) -> str:
    """sha256 of a network's weights (names, shapes and float32 values, in name order): which model a
    student was distilled from, whatever file or device holds it."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().to('cpu', torch.float32).contiguous()
        digest.update(f'{name}{tuple(tensor.shape)}'.encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def checkpoint_model_config(ckpt: dict, named_as: str) -> UNetConfig:
    try:
        return UNetConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in ckpt['model_config'].items()})
    except (TypeError, ValueError, AttributeError) as error:
        raise ConfigError(f'{named_as}: not a train.py checkpoint (its model_config: {brief(error)})') from None


def model_from_checkpoint(ckpt: dict, weights: str, named_as: str) -> UNet:
    """The UNet of a checkpoint with its 'ema' or 'model' weights, in eval mode on the CPU."""
    if ckpt.get(weights) is None:
        raise ConfigError(f'{named_as} holds no {weights} weights')
    model = UNet(checkpoint_model_config(ckpt, named_as))
    try:
        model.load_state_dict(ckpt[weights])
    except (RuntimeError, TypeError, AttributeError) as error:
        raise ConfigError(f'{named_as}: its {weights} weights do not fit its model_config '
                          f'({brief(error, 300)})') from None
    return model.eval()


def check_resumable(ckpt: dict, named_as: str, config: dict, model_config: UNetConfig, world_size: int):
    """An exact resume needs the same architecture, the same RESUME_MUST_MATCH settings and the
    same number of ranks (one RNG state each). Checked before any data is loaded."""
    missing = [key for key in RESUME_REQUIRED if key not in ckpt]
    if missing:
        raise ConfigError(f'{named_as}: not a complete train.py checkpoint (it lacks {", ".join(missing)})')
    diffs = architecture_differences(ckpt['model_config'], model_config)
    if diffs:
        raise ConfigError(f'{named_as}: the checkpoint is another architecture: {", ".join(diffs)}')
    for weights in ('model', 'ema'):
        if ckpt[weights] is not None:
            require_finite(ckpt[weights], f'{named_as}: its {weights} weights', 'resume an earlier checkpoint')
    try:
        saved, ranks = {**SETTINGS_BEFORE_THEY_EXISTED, **ckpt['config']}, len(ckpt['rng'])
        differing = [name for name in RESUME_MUST_MATCH if saved[name] != config[name]]
    except (KeyError, TypeError) as error:
        raise ConfigError(f'{named_as}: not a complete train.py checkpoint ({brief(error)})') from None
    for name in differing:
        raise ConfigError(f'{named_as}: the checkpoint has --{name.replace("_", "-")} {saved[name]}, this run '
                          f'{config[name]}; an exact resume needs the same value')
    if ranks != world_size:
        raise ConfigError(f'{named_as}: written by {ranks} ranks, this run has {world_size}')


def check_same_data(ckpt: dict, named_as: str, data_identity: dict, data_dir: str):
    """An exact resume needs the same images: the checkpoint's image count and fingerprint
    (data.fingerprint) against those of the data set loaded now."""
    saved = ckpt.get('data')
    if saved is None:
        return  # a checkpoint from before fingerprints: the settings check is all there is
    if saved != data_identity:
        raise ConfigError(f"{named_as}: the checkpoint was trained on another data set ({saved['count']} images, "
                          f"fingerprint {saved['fingerprint'][:12]}); {data_dir} has {data_identity['count']} "
                          f"images, fingerprint {data_identity['fingerprint'][:12]}")


def architecture_differences(theirs, config: UNetConfig) -> list:
    """'field=theirs (now ours)' for every field of the network in which a saved model_config
    (a dict) differs from `config`; attention, dropout and the fused norm hold no weights and may differ."""
    theirs = theirs if isinstance(theirs, dict) else {}
    theirs = {'num_classes': 0, **theirs}  # a network from before class conditioning had no classes
    why = {'in_channels': ': channel counts differ', 'num_classes': ': --class-cond differs'}
    return [f'{k}={theirs.get(k)!r} (now {v!r}{why.get(k, "")})'
            for k, v in asdict(config).items()
            if _plain(theirs.get(k)) != _plain(v) and k not in ('attention', 'dropout', 'fused_norm')]


def initial_weights(path: str, config: UNetConfig, prediction: str = 'eps') -> dict:
    """The state dict that train.py --init-from starts from: a checkpoint of ours (its EMA weights)
    or a diffusers UNet2DModel / pipeline folder, refused with one line unless it is the network
    of `config` trained to predict what this run predicts (an eps network's output is no v)."""
    named_as = f'--init-from {path}'
    if os.path.isdir(path):
        model, theirs_predict = read_diffusers(path, named_as), diffusers_scheduler(path, named_as)['prediction']
        theirs = asdict(model.config)
    else:
        ckpt = read_checkpoint(path, named_as)
        model, theirs = model_from_checkpoint(ckpt, 'ema', named_as), ckpt['model_config']
        theirs_predict = ckpt['config'].get('prediction', 'eps')
    require_finite(model.state_dict(), f'{named_as}: its weights', 'start from an earlier checkpoint')
    if theirs_predict != prediction:
        raise ConfigError(f'{named_as}: its network predicts {theirs_predict}, this run --prediction {prediction}: '
                          f'start from a network that predicts {prediction}')
    diffs = architecture_differences(theirs, config)
    if diffs:
        raise ConfigError(f'{named_as}: another architecture than --preset, --image-size and --dataset give: '
                          f'{", ".join(diffs)}')
    return model.state_dict()


def require_finite(state: dict, named_as: str, instead: str):
    """Weights are read only when every one is finite: a NaN would make every sample, loss and
    step NaN. `named_as` names them ('--resume PATH: its ema weights'), `instead` says what to do."""
    if not all(t.isfinite().all() for t in state.values() if t.is_floating_point()):
        raise ConfigError(f'{named_as} are not finite (NaN or inf): {instead}')


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


# ----------------------------------------------------------------------------- a run's state

def checkpoint_state(run: Run, step: int, eval_owed: bool = False, train_seconds: float = 0.0,
                     wall_seconds: float = 0.0) -> dict:
    """The checkpoint, in the format above. Every rank must call it: rank 0 gathers the RNG states of
    all ranks. eval_owed: an evaluation due at this step did not run (a stop came first);
    train_seconds, wall_seconds: the training and the loop's wall time so far, counted on by a
    resumed run."""
    (rng_all,) = gather_to_rank0((rng_states(run.device),), run.rank, run.world_size, run.control_group)
    epoch, batch = divmod(step, run.loader.batches_per_epoch)
    return {'model': run.model.state_dict(), 'ema': run.ema.state_dict() if run.ema is not None else None,
            'optimizer': run.optimizer.state_dict(), 'scaler': run.scaler.state_dict(), 'step': step,
            'epoch': epoch, 'batch_in_epoch': batch, 'config': asdict(run.cfg),
            'model_config': asdict(run.model.config), 'model_version': MODEL_VERSION, 'rng': rng_all,
            'data': run.data_identity, 'eval_owed': eval_owed, 'train_seconds': train_seconds,
            'wall_seconds': wall_seconds, 'flags': run.flags}


def restore(run: Run, ckpt: dict) -> int:
    """Loads a checkpoint into the run; returns the step to continue from."""
    load_states(f'--resume {run.cfg.resume}', [(run.model, ckpt.get('model')), (run.ema, ckpt.get('ema')),
                                              (run.optimizer, ckpt.get('optimizer')),
                                              (run.scaler, ckpt.get('scaler'))])
    for group in run.optimizer.param_groups:  # the run's --adam-beta2, not the one the state saved
        group['betas'] = (0.9, run.cfg.adam_beta2)
    set_rng_states(ckpt['rng'][run.rank], run.device)
    return ckpt['step']


def weights_problem(run: Run, heldout, row: dict) -> str | None:
    """Why train.py must not save the weights of `run` (None: it may): a non-finite weight of the model or
    the EMA, or a non-finite held-out loss of either (from this step's log row, or after a stop, which skips
    it, from one batch of the held-out set)."""
    for name, module in (('weights', run.model), ('EMA weights', run.ema)):
        if module is not None and not weights_finite(module):
            return f'non-finite {name}'
    if heldout is None:
        return None
    for key, module in (('heldout_loss', run.model), ('heldout_loss_ema', run.ema)):
        loss = row.get(key)
        if loss is None:
            with own_rng(run.device):
                few = tuple(x[:run.cfg.batch_size] for x in heldout)
                loss = evaluation.heldout_losses(module, run.sched, few, run.cfg, run.device).mean().item()
        if not math.isfinite(loss):
            return f"a held-out loss of {loss} ({'EMA' if 'ema' in key else 'model'})"
    return None


def save_if_good(run: Run, step: int, log, eval_owed: bool, path: str, heldout, row: dict, last_good):
    """The checkpoint of this step, once proven good; a broken model stops the run instead, and
    the last good checkpoint stays (every rank agrees)."""
    with log.paused():
        problem = weights_problem(run, heldout, row)
        if any_rank(problem is not None, run.control_group):
            raise NonFiniteLoss(f"at step {step}: {problem or 'a problem on another rank'}; stopping without a "
                                f"checkpoint. " + last_good_note(last_good))
        state = checkpoint_state(run, step, eval_owed, log.training_seconds(), log.wall_seconds())
        if run.rank == 0:
            save_checkpoint(state, path)
