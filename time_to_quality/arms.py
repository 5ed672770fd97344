"""The arms of the time-to-quality ladder as data: the baseline, each
lever with the train.py flags it adds and what judges it, diffusers' recipe over its grid, and the
prediction study's arms. Nothing here trains; `preset` is the TrainConfig that train.py resolves the
ladder's common flags to (its batch, lr and warm-up)."""
import math
from dataclasses import dataclass, field


@dataclass
class Arm:
    name: str
    changes: str  # what it changes, in words
    flags: list = field(default_factory=list)  # train.py flags on top of the common ones; a recipe's --batch-size, --lr
    recipe: bool = False  # diffusers' training example instead of train.py


# What judges a lever (stats.paired_gain): 'speed', img/s over the planned run, from short runs;
# 'images', images to the target (it leaves the step's work unchanged, so that the machine's speed cannot
# decide it); 'minutes', training minutes to the target (images / img/s: it changes the step's work too).
JUDGES = ('speed', 'images', 'minutes')


@dataclass
class Lever:
    name: str
    changes: str
    flags: list
    judged_by: str  # one of JUDGES
    images: int | None = None  # the planned images of its runs and, once kept, of the arms above it (None: unchanged)

    @property
    def part(self) -> str:
        return 'speed' if self.judged_by == 'speed' else 'quality'


BASELINE = ['--amp', 'off', '--no-compile', '--no-channels-last', '--no-fused-adam']  # fp32 eager, as the paper's
BASELINE_ARM = Arm('baseline', "the paper's recipe as train.py runs it here: fp32, eager, NCHW, foreach Adam", BASELINE)


def levers(cfg, preset, bf16: bool) -> list:
    """Every lever, in the order of the speed-up table: how fast a step runs (bf16 where the device has
    it), then how many images the samples need (the batch lever doubles the preset's batch, its lr x
    sqrt(2); the ones after it are the literature's, docs/training.md#levers-of-the-images-needed, then
    the preset's own settings: its peak lr, dropout and warm-up)."""
    batch, lr = doubled_batch(preset)
    peak_lr, plan = one_digit(2 * preset.lr), decay_plan(cfg)
    return ([Lever('+ bf16', 'bf16 autocast', ['--amp', 'bf16'], 'speed')] if bf16 else []) + [
        Lever('+ channels-last', 'channels-last memory format', ['--channels-last'], 'speed'),
        Lever('+ fused Adam', 'one fused Adam kernel', ['--fused-adam'], 'speed'),
        Lever('+ compile', 'torch.compile of the whole loss (Inductor; its compile time is counted)', ['--compile'],
              'speed'),
        Lever('+ v-prediction', 'the network predicts v (Salimans & Ho, 2022)', ['--prediction', 'v'], 'images'),
        Lever('+ Min-SNR-5', 'loss weights min(SNR, 5) (Hang et al., 2023)', ['--loss-weight', 'min-snr'], 'images'),
        Lever(f'+ batch {batch}', f"twice the {cfg.preset} preset's batch, the learning rate x sqrt(2) ({lr})",
              ['--batch-size', str(batch), '--lr', lr], 'minutes'),
        Lever('+ cosine lr decay', f'the lr decays with a cosine to 0 at the planned end, {plan:,} images '
              "(diffusers' recipe; Loshchilov & Hutter, 2017)", ['--lr-decay', 'cosine'], 'images', plan),
        Lever('+ log-normal t', "t drawn so that ln sigma ~ N(-1.2, 1.2^2) (EDM, Karras et al., 2022)",
              ['--t-sampling', 'lognormal'], 'images'),
        Lever('+ Laplace t', 't drawn so that the log-SNR ~ Laplace(0, 0.5) (Hang et al., 2024); replaces a kept '
              'log-normal t', ['--t-sampling', 'laplace'], 'images'),
        Lever('+ input perturbation', "the network's input made with eps + 0.1 xi, its target eps (DDPM-IP, Ning et "
              'al., 2023)', ['--input-perturbation', '0.1'], 'images'),
        Lever('+ Adam beta2 0.99', "Adam's beta2 0.99 (the paper's: 0.999)", ['--adam-beta2', '0.99'], 'images'),
        Lever('+ EMA half-life 5%', "the EMA's half-life 5% of the images seen (EDM)", ['--ema-length', '0.05'],
              'images'),
        Lever('+ immiscible noise', "each image paired with the nearest of its batch's noise draws (Li et al., 2024)",
              ['--immiscible'], 'minutes'),
        Lever('+ reweighted log-normal t', "t drawn as by '+ log-normal t', each loss weighted by (1/T) / p(t): "
              "L_simple's objective kept, its variance changed", ['--t-sampling', 'lognormal', '--t-reweight'],
              'images'),
        Lever('+ reweighted Laplace t', "t drawn as by '+ Laplace t', each loss weighted by (1/T) / p(t); replaces "
              'a kept reweighted log-normal t', ['--t-sampling', 'laplace', '--t-reweight'], 'images'),
        Lever(f'+ peak lr {peak_lr}', f"twice the {cfg.preset} preset's peak learning rate", ['--lr', peak_lr],
              'images'),
        Lever('+ dropout 0.1', "dropout 0.1 in the residual blocks (the paper's CIFAR-10 setting)",
              ['--dropout', '0.1'], 'minutes'),
        Lever(f'+ warm-up {10 * preset.warmup}', f"a warm-up ten times the {cfg.preset} preset's",
              ['--warmup', str(10 * preset.warmup)], 'images')]


def recipe_variants(cfg, preset) -> list:
    """diffusers' recipe at its own settings (batch 16, lr 1e-4), its lr over a grid at its batch and at
    ours, and at the batch lever's batch and lr: the tuning our arms had."""
    batch, lr = doubled_batch(preset)
    grid = [(16, lr_) for lr_ in ('1e-4', '3e-4', '1e-3')] + [(preset.batch_size, lr_) for lr_ in (
        '3e-4', '1e-3', one_digit(preset.lr))] + [(batch, lr)]
    return chosen(cfg, [Arm('diffusers recipe' if (batch, lr) == (16, '1e-4') else f'diffusers b{batch} lr {lr}',
                            "diffusers' train_unconditional.py loop and settings (AdamW, cosine to the run's "
                            f"planned end, EMAModel warm-up, 0 workers, our flip rule), batch {batch}, lr {lr}",
                            ['--batch-size', str(batch), '--lr', lr], recipe=True)
                        for batch, lr in dict.fromkeys(grid)])


def prediction_arms() -> list:
    """The paper's objective against v-prediction, Min-SNR-5 and both, at the baseline's speed."""
    return [BASELINE_ARM,
            Arm('v-prediction', 'v-prediction', BASELINE + ['--prediction', 'v']),
            Arm('Min-SNR-5', 'Min-SNR-5 weights (eps)', BASELINE + ['--loss-weight', 'min-snr']),
            Arm('v + Min-SNR-5', 'both', BASELINE + ['--prediction', 'v', '--loss-weight', 'min-snr'])]


def shape_arms() -> list:
    """The tiny preset's shape (base 16 channels, multipliers 1,2,2, one block per level, attention at 8x8)
    against narrower, wider and deeper, without attention, with two levels, and narrow with twice the peak lr: each
    at the baseline's settings otherwise. Each changes the step's work: judged on images to the target,
    and on minutes through img/s measured interleaved in one process (arm_speed.py)."""
    return [BASELINE_ARM,
            Arm('width 8', 'base channels 8 (the preset: 16)', BASELINE + ['--base-channels', '8']),
            Arm('width 32', 'base channels 32', BASELINE + ['--base-channels', '32']),
            Arm('depth 2', 'two residual blocks per level (the preset: one)', BASELINE + ['--blocks-per-level', '2']),
            Arm('no attention', 'no self-attention in the levels (the preset: at 8x8; the middle block keeps its '
                'own at 4x4)', BASELINE + ['--attn-resolutions', 'none']),
            Arm('two levels', 'channel multipliers 1,2: the 4x4 level left out',
                BASELINE + ['--channel-mults', '1,2']),
            Arm('width 8 + peak lr 4e-3', "base channels 8 and twice the preset's peak lr",
                BASELINE + ['--base-channels', '8', '--lr', '4e-3'])]


STUDIES = {'prediction': prediction_arms, 'shape': shape_arms}  # side-by-side ladders: each arm on the baseline


def decay_plan(cfg) -> int:
    return cfg.decay_images or max(1, cfg.images // 2)


def chosen(cfg, items: list) -> list:
    names = {n.strip() for n in cfg.arms.split(',') if n.strip()}
    return [i for i in items if not names or i.name in names or i.name == 'diffusers recipe']


def doubled_batch(preset) -> tuple:
    """The batch lever's setting: twice the preset's batch, its lr x sqrt(2) to one digit (2e-3 -> '3e-3')."""
    return 2 * preset.batch_size, one_digit(preset.lr * math.sqrt(2))


def one_digit(lr: float) -> str:
    mantissa, exponent = f'{lr:.0e}'.split('e')
    return f'{mantissa}e{int(exponent)}'  # 2.83e-3 -> '3e-3'


def slug(name: str) -> str:
    return '-'.join(''.join(c if c.isalnum() else ' ' for c in name.lower()).split())  # '+ bf16' -> 'bf16'
