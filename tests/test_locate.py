"""A MISMATCH says where (issue 27): planted one-module slips, each located at the right module, loss,
statistic or optimizer update, with every module call before it agreeing; and a correct port,
located nowhere (the negative control).

Each port's location is computed once (``located``): one more first step on each side and on the
twin, D = 2, the suite's tiny ports (the example MLP, the corpus's bias-before-BatchNorm).
"""

import dataclasses
import functools
import os
import re
import sys
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ROOT, require_devices
from flax import nnx

from equivalence import ModelPort
from equivalence import run as run_command
from equivalence.core import harness, kinds
from equivalence.core.compare import location, rule
from equivalence.core.compare.findings import Finding
from equivalence.core.compare.location import Unplaced
from equivalence.core.compare.outcome import Outcome
from equivalence.core.locate import first_step, implied, locate, recorded_run, slots
from equivalence.core.locate.first_step import Recorder
from equivalence.core.port import workloads
from equivalence.core.port.config import RunConfig
from equivalence.core.report import plots, render, words
from equivalence.core.run import inputs as made
from equivalence.core.run import model_side
from equivalence.core.twins import probe
from equivalence.corpus import batchnorm

sys.path.insert(0, os.path.join(ROOT, 'examples', 'mlp_port'))
import my_port  # noqa: E402  (the example, imported as a user's module)
import nnx_code  # noqa: E402

DEVICES = 2


# -- the planted slips, each one constant of one module on the NNX side ---------------------------


class BatchNormEps(batchnorm.NnxBiasBN):
    def __init__(self, *, rngs: nnx.Rngs):
        super().__init__(rngs=rngs)
        self.norm = nnx.BatchNorm(batchnorm.HIDDEN, momentum=batchnorm.MOMENTUM, epsilon=1e-3, rngs=rngs)  # linen 1e-5


class DropoutRate(nnx_code.MLP):
    def __init__(self, *, rngs: nnx.Rngs):
        super().__init__(rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)  # linen 0.1


def loop_with(tx: optax.GradientTransformation):
    """The example's loop port whose NNX optimizer is ``tx`` (linen: AdamW 3e-3, weight decay 1e-4)."""
    return dataclasses.replace(my_port.LOOP, new_state=lambda model: (model, nnx.Optimizer(model, tx, wrt=nnx.Param)))


class LinenClassifier(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name='head')(nn.relu(nn.Dense(16, name='fc')(x)))


class NnxClassifier(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.fc, self.head = nnx.Linear(20, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.fc(x)))


def classes(rng: np.random.Generator, n_steps: int, batch: int) -> dict:
    data = workloads.mlp_data(rng, n_steps, batch)
    return {'x': data['x'], 'y': (np.argmax(data['x'][..., :4], axis=-1)).astype(np.int32)}


def smoothed(logits, y, smoothing: float):
    return optax.softmax_cross_entropy(logits, optax.smooth_labels(jax.nn.one_hot(y, 4), smoothing))


SMOOTHING = ModelPort(
    name='smoothing',
    legacy_model=LinenClassifier,
    nnx_model=lambda rngs: NnxClassifier(rngs=rngs),
    legacy_loss=lambda model, params, state, batch, noise: smoothed(
        model.apply({'params': params}, batch['x']), batch['y'], 0.1
    ),
    nnx_loss=lambda model, batch, noise: smoothed(model(batch['x']), batch['y'], 0.0),  # label smoothing left out
    make_data=classes,
    make_tx=lambda lr_scale=1.0: optax.adam(1e-3 * lr_scale),
    init_args=lambda batch: (batch['x'],),
)


@jax.jit
def opaque_forward(params: dict, x):
    """The NNX forward as a precompiled function would be: no module is called (and its LayerNorm left out)."""
    h = jax.nn.gelu(x @ params['fc1']['kernel'] + params['fc1']['bias'])
    return h @ params['fc2']['kernel'] + params['fc2']['bias']


def opaque_call(train_state, key, batch_KxG):
    model, optimizer = train_state

    def step(carry, batch):
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return carry, jnp.mean((opaque_forward(params, batch[0]) - batch[1]) ** 2)

    return train_state, jax.lax.scan(step, 0, batch_KxG)[1]


class LinenTwoDropouts(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.Dropout(0.1, deterministic=not train)(nn.relu(nn.Dense(16, name='fc')(x)))
        h = nn.Dropout(0.1, deterministic=not train)(nn.relu(nn.Dense(8, name='mid')(h)))
        return nn.Dense(4, name='head')(h)


class NnxOneDropout(nnx.Module):
    """The linen model with its first Dropout left out: its one Dropout pairs with linen's first, whose
    input has another shape (ViT's attention dropout left out, tried blind, was 'between ... → Dropout_0 ↔
    ... → mlp/drop1: the input is - apart (allowed -)')."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.fc, self.mid = nnx.Linear(20, 16, rngs=rngs), nnx.Linear(16, 8, rngs=rngs)
        self.head = nnx.Linear(8, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return self.head(self.drop(nnx.relu(self.mid(nnx.relu(self.fc(x))))))


DROPOUT_LEFT_OUT = ModelPort(
    name='dropout-left-out',
    legacy_model=LinenTwoDropouts,
    nnx_model=lambda rngs: NnxOneDropout(rngs=rngs),
    legacy_loss=lambda model, params, state, batch, noise: smoothed(
        model.apply({'params': params}, batch['x'], train=True), batch['y'], 0.0
    ),
    nnx_loss=lambda model, batch, noise: smoothed(model(batch['x']), batch['y'], 0.0),
    make_data=classes,
    make_tx=lambda lr_scale=1.0: optax.adam(1e-3 * lr_scale),
    init_args=lambda batch: (batch['x'], False),
)


PENALTY = 1e-3  # an L2 term the NNX step trains on and does not report
SHRINK = 0.9  # targets the NNX step trains towards, times the true ones (a regression's label smoothing)


def penalised(m, batch):
    """The example's loss with an L2 term on the kernels; the plain loss reported, as the pmap step's."""
    loss = jnp.mean(nnx_code.per_example_loss(m, batch))
    l2 = sum(jnp.sum(x**2) for x in jax.tree.leaves(nnx.state(m, nnx.Param)) if x.ndim > 1)
    return loss + PENALTY * l2, loss


def shrunk(m, batch):
    """The example's loss (``nnx_code.per_example_loss``) towards ``SHRINK`` times the targets; the plain
    loss reported, of the same forward pass (one draw of its dropout)."""
    x, y = batch
    out = m(x)
    return jnp.mean((out - SHRINK * y) ** 2), jnp.mean((out - y) ** 2)


def calls_training_on(train_loss):
    """The example's NNX loop, trained on ``train_loss(model, batch) -> (loss, reported loss)``."""

    @nnx.jit
    def calls(model, optimizer, key, batch_KxG):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def step(carry, batch):
            model, optimizer, key = carry
            key, step_key = jax.random.split(key)
            nnx.reseed(model, dropout=step_key)
            (_, loss), grads = nnx.value_and_grad(lambda m: train_loss(m, batch), has_aux=True)(model)
            optimizer.update(model, grads)
            return (model, optimizer, key), loss

        return step((model, optimizer, key), batch_KxG)[1]

    return calls


def trained_on(train_loss):
    calls = calls_training_on(train_loss)
    return dataclasses.replace(my_port.LOOP, new_call=lambda ts, key, batch: (ts, calls(*ts, key, batch)))


class LinenSelfAttention(nn.Module):
    """Attention as flax's linen lm1b/wmt write it: ``nn.SelfAttention``, whose ``__call__`` calls its
    parent's (``MultiHeadDotProductAttention``), handing it the dropout key, with dropout on."""

    @nn.compact
    def __call__(self, x):
        y = nn.SelfAttention(num_heads=2, qkv_features=8, use_bias=False, dropout_rate=0.1, deterministic=False)(
            nn.Embed(16, 8)(x), nn.make_causal_mask(x)
        )
        return nn.Dense(16, name='head')(nn.relu(nn.Dense(8, name='hidden')(y)))


class NnxSelfAttention(nnx.Module):
    def __init__(self, act=nnx.relu, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(16, 8, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8, use_bias=False,
                                                dropout_rate=0.1, decode=False, rngs=rngs)  # fmt: skip
        self.hidden, self.head, self.act = nnx.Linear(8, 8, rngs=rngs), nnx.Linear(8, 16, rngs=rngs), act

    def __call__(self, x):
        y = self.attention(self.embed(x), mask=nnx.make_causal_mask(x), deterministic=False)
        return self.head(self.act(self.hidden(y)))


def next_token_loss(logits, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean(-1)


ATTENTION_GELU = ModelPort(  # the slip: gelu for relu after the attention (found on flax's own lm1b_nnx)
    name='attention-gelu',
    legacy_model=LinenSelfAttention,
    nnx_model=lambda rngs: NnxSelfAttention(nnx.gelu, rngs=rngs),
    legacy_loss=lambda model, params, state, batch, noise: next_token_loss(
        model.apply({'params': params}, batch), batch
    ),
    nnx_loss=lambda model, batch, noise: next_token_loss(model(batch), batch),
    make_data=lambda rng, n_steps, batch: rng.integers(0, 16, size=(n_steps, batch, 4)).astype(np.int32),
    make_tx=lambda lr_scale: optax.adam(1e-2 * lr_scale),
    names={'Embed_0': 'embed', 'SelfAttention_0': 'attention', 'hidden': 'hidden', 'head': 'head'},
    default_batch=16,
)

PORTS = {
    'correct': my_port.LOOP,
    'layernorm-eps': my_port.LOOP_EPSILON_SLIP,  # NNX LayerNorm epsilon 1e-5, linen 1e-6
    'gelu': my_port.MODEL_GELU_SLIP,  # exact gelu after the LayerNorm, linen approximate
    'dropout-rate': dataclasses.replace(my_port.MODEL, nnx_model=lambda rngs: DropoutRate(rngs=rngs)),
    'batchnorm-eps': dataclasses.replace(batchnorm.PORT, nnx_model=lambda rngs: BatchNormEps(rngs=rngs)),
    'smoothing': SMOOTHING,
    'weight-decay': loop_with(optax.adamw(3e-3, weight_decay=1e-2)),  # PyTorch's default AdamW decay
    'eps': loop_with(optax.adamw(3e-3, weight_decay=1e-4, eps=1e-7)),  # Keras's default Adam epsilon
    'opaque': dataclasses.replace(my_port.LOOP, new_call=opaque_call),
    'b1': loop_with(optax.adamw(3e-3, b1=0.95, weight_decay=1e-4)),  # (1 - b1) half the pmap side's
    'train-loss': trained_on(penalised),
    'train-targets': trained_on(shrunk),
    'attention-gelu': ATTENTION_GELU,
    'dropout-left-out': DROPOUT_LEFT_OUT,
}


@functools.cache
def located(name: str) -> locate.Location:
    require_devices(DEVICES)
    port = PORTS[name]
    config = RunConfig(workload=name, devices=DEVICES, steps_per_call=1, calls=1, batch_size=port.default_batch,
                       rng_mode=port.rng_modes[0])  # fmt: skip
    return located_with(port, config, 1)


def located_with(port, config, twin_kind) -> locate.Location:
    """Where the first step parts, recorded beside ``twin_kind`` (as the verdict records it)."""
    kind, fed = kinds.of(port), made.make(port, config)
    return locate.locate(kind, config, fed, Recorder(kind, config, fed, twin_kind))


def first(loc: locate.Location) -> location.Module:
    """The call the location names, after asserting that every call before it agrees."""
    assert loc.first is not None, loc.line()
    before = loc.modules[: loc.first]
    assert before and all(m.input_ok and m.output_ok for m in before), loc.lines()
    return loc.modules[loc.first]


def agree(loc: locate.Location) -> None:
    assert loc.modules and all(m.input_ok and m.output_ok for m in loc.modules), [vars(m) for m in loc.modules]


# -- forward -----------------------------------------------------------------------------------


def test_a_layernorm_epsilon_is_located_at_that_layernorm():
    loc = located('layernorm-eps')
    assert (loc.kind, loc.legacy, loc.new) == ('module', 'LayerNorm_0', 'norm'), loc.line()
    assert loc.settings == (('epsilon', 1e-06, 1e-05),), loc.line()  # the constant itself
    m = first(loc)  # Dense_0 (fc1) before it agrees
    assert m.input_ok and not m.output_ok
    assert [c.legacy for c in loc.modules[: loc.first]] == ['Dense_0']


def test_a_batchnorm_epsilon_is_located_at_that_batchnorm():
    loc = located('batchnorm-eps')
    assert (loc.kind, loc.legacy, loc.new) == ('module', 'BatchNorm_0', 'norm'), loc.line()
    assert loc.settings == (('epsilon', 1e-05, 0.001),), loc.line()
    m = first(loc)
    assert m.input_ok and not m.output_ok and loc.modules[0].legacy == 'fc1'


def test_a_swapped_activation_is_the_code_between_two_agreeing_modules():
    """gelu(approximate=False) between the LayerNorm and the Dropout (names='structure')."""
    loc = located('gelu')
    assert (loc.kind, loc.legacy, loc.new) == ('between', 'LayerNorm_0 → Dropout_0', 'norm → drop'), loc.line()
    m = first(loc)
    assert not m.input_ok and loc.modules[loc.first - 1].legacy == 'LayerNorm_0'
    # the call before, by the order the calls finished: no data flow is claimed (google/mipnerf's level 1, tried
    # blind, was said fed by 'the code after' its rgb head, where its density head feeds it)
    assert (loc.reading['before'], loc.reading['call']) == ('LayerNorm_0', 'Dropout_0'), loc.reading
    assert 'the code between LayerNorm_0 (the call before) and Dropout_0 differs' in loc.figures, loc.figures


def test_an_activation_after_a_linen_self_attention_with_dropout_is_located_after_it():
    """linen's ``SelfAttention`` runs its parent's ``__call__`` inside its own: one call, recorded once, whose
    inputs are what the model handed it (before, the inner call, given the dropout key too, was the one
    paired, its inputs never agreed, and every slip of flax's lm1b_nnx port was located at the attention)."""
    loc = located('attention-gelu')
    assert (loc.kind, loc.legacy, loc.new) == ('between', 'hidden → head', 'hidden → head'), loc.line()
    first(loc)  # every call before it agrees: the embedding and the attention, dropout and all
    before = [m.legacy for m in loc.modules[: loc.first]]
    assert before[0] == 'Embed_0' and before.count('SelfAttention_0') == 1 and before[-1] == 'hidden', before


def test_a_dropout_that_draws_otherwise_is_randomness_at_that_dropout():
    loc = located('dropout-rate')
    assert (loc.kind, loc.legacy, loc.new) == ('randomness', 'Dropout_0', 'drop'), loc.line()
    assert loc.settings == (('rate', 0.1, 0.2),), loc.line()
    m = first(loc)
    assert m.input_ok and not m.output_ok


def test_a_call_whose_inputs_cannot_be_compared_is_not_a_place():
    """A Dropout left out on the new side pairs linen's first Dropout with the new side's only one, whose
    input has another shape: no figure says where the sides part, so nothing is named (was 'between at
    ... → Dropout_0', its difference '-')."""
    loc = located('dropout-left-out')
    assert loc.why is Unplaced.UNCOMPARED and loc.reading['legacy_call'] == 'Dropout_0', loc.line()


# -- loss, statistics, update --------------------------------------------------------------------


def test_label_smoothing_left_out_is_the_loss_while_every_module_agrees():
    loc = located('smoothing')
    assert loc.kind == 'loss' and loc.reading['parts'] == 'loss', loc.line()  # the loss function differs
    agree(loc)


def test_first_moments_apart_from_zero_give_no_ratio_and_still_read_the_decay():
    """A zero-initialised head gives the body no gradient on step 1, so the pmap side's first moments are 0
    where a coupled weight decay (1e-4) makes the new side's 1e-4 x the parameter (vision_transformer, tried
    blind): no ratio NNX/pmap is said (it read 'from nan to nan'), and the decay is still read."""
    rng = np.random.default_rng(0)
    p0 = {f'w{i}': rng.normal(size=16).astype(np.float32) for i in range(3)}
    leaves = {k: (np.zeros(16, np.float32), np.float32(1e-4) * p, 1e-9) for k, p in p0.items()}
    g = rng.normal(size=4).astype(np.float32)
    p0['head'], leaves['head'] = np.zeros(4, np.float32), (g, g, 1e-9)  # the head: its gradient, no decay of 0
    said = implied.moments('trace', leaves, p0)
    read = said.values()  # no ratio NNX/pmap, the pmap side's 0 wherever the 3 leaves that part do
    assert 'ratio' not in read and read['zeros'] == 3, said
    assert read['proportional'] == pytest.approx(1e-4, rel=5e-4) and read['r2'] >= 0.9995, said.text


def test_a_training_loss_the_loop_does_not_report_is_the_gradients_not_the_optimizer():
    """A loop port's NNX step trains on an L2 term its reported loss leaves out: the forward pass and
    the reported loss agree, the gradients are the port's own (not observed), and Adam's first moment
    is the first thing that parts. Its elements part by no common factor, as a b1, a momentum or a
    clip would make them (the control below), and their difference is a multiple of the parameters: an
    L2 term in the training loss, or a coupled weight decay in the optimizer, which give the same numbers.
    Two places: none is named (issue 40: imagenet's weight decay was 'backward at' the kernel whose moment
    parts most), and the reading is said."""
    loc = located('train-loss')
    assert loc.why is Unplaced.LOSS_OR_DECAY, loc.line()
    read = loc.reading  # mu = 0.1 (g + 2e-3 p): the gradients 2e-3 x the parameter apart, if b1 is 0.9
    assert read['proportional'] == pytest.approx(2 * PENALTY * 0.1, rel=5e-3), loc.line()
    assert read['l2'] == pytest.approx(2 * PENALTY, rel=5e-3), loc.line()
    agree(loc)


def test_a_training_loss_on_the_output_that_the_loop_does_not_report_is_the_loss():
    """The NNX step trains towards 0.9 times the targets and reports the plain loss, as the pmap step
    does (the wmt example reports its loss without its label smoothing). The forward pass and the
    reported loss agree; the gradient of the training loss with respect to the model's output does
    not: the loss. The L2 term above, on the parameters, leaves that gradient equal (its control)."""
    loc = located('train-targets')
    assert loc.kind == 'loss', loc.line()
    assert loc.reading['parts'] == 'output gradient', loc.line()  # the gradient of the training loss w.r.t. it
    agree(loc)


def test_a_b1_change_parts_the_first_moments_by_one_factor_and_stays_the_optimizer():
    """The negative control of the one above: NNX b1 0.95 for 0.9 halves every element of the first
    moment (Adam's first update is unchanged): one factor, the update, and the b1 it implies."""
    loc = located('b1')
    assert loc.kind == 'update' and loc.legacy.startswith('opt_state 0/mu/'), loc.line()
    assert loc.reading['factor'] == pytest.approx(0.5, abs=5e-7), loc.line()  # one factor on every element
    assert loc.reading['b1'] == pytest.approx(0.95, abs=5e-5), loc.line()  # NNX's, if the pmap side's is 0.9
    assert loc.reading['gradients'] == 'not observed', loc.line()  # a loop port: its own step's
    agree(loc)


WARMUP = dataclasses.replace(
    SMOOTHING,
    name='warmup',
    nnx_loss=lambda model, batch, noise: smoothed(model(batch['x']), batch['y'], 0.1),  # as linen's
    make_tx=lambda lr_scale=1.0: optax.adam(optax.linear_schedule(0.0, 1e-3 * lr_scale, 10)),  # 0 at step 1
)


@pytest.mark.parametrize('steps', [1, 2])
def test_an_optimizer_slip_that_warmup_hides_on_step_1_is_located_on_step_2(steps):
    """NNX's learning rate 1.01 times linen's (``perturb``) under a warmup from 0: step 1 updates
    nothing on either side, so nothing parts on it. With a second step recorded, step 2 is judged
    and the update rule named, with the factor; with one step only (the control), step 1 says why it
    cannot see an optimizer, and nothing is guessed."""
    require_devices(DEVICES)
    config = RunConfig(workload='warmup', devices=DEVICES, steps_per_call=steps, calls=1, perturb=1e-2,
                       batch_size=WARMUP.default_batch, rng_mode=WARMUP.rng_modes[0])  # fmt: skip
    loc = located_with(WARMUP, config, 1)
    if steps == 1:
        assert loc.kind == 'none' and locate.WARMUP in loc.figures, loc.line()
        return
    assert (loc.kind, loc.legacy) == ('update', 'the update rule'), loc.line()
    read = loc.reading  # on step 2, nothing parting before it, step 1's update 0
    assert (read['step'], read['exact'], read['first_update_zero']) == (2, True, True), loc.line()
    assert read['update'] == 'step factor' and read['update_factor'] == pytest.approx(1.01, abs=5e-6), loc.line()
    assert read['gradients'] == 'agree', loc.line()  # a model port: the suite computed both sides'
    agree(loc)


@pytest.mark.parametrize(
    'name, implies',
    [('weight-decay', 'a decoupled weight decay'), ('eps', "an adaptive optimizer's eps")],  # nesterov: below
)
def test_an_optimizer_only_change_is_the_update_and_says_what_its_size_implies(name, implies):
    loc = located(name)
    assert (loc.kind, loc.legacy) == ('update', 'the update rule'), loc.line()
    assert implies in loc.figures, loc.line()
    agree(loc)  # the forward pass is untouched


def test_a_batchnorm_momentum_is_its_statistics_located_through_the_verdict(tmp_path):
    """End to end: ``check`` on the corpus's momentum slip (0.1, PyTorch's convention, for linen's 0.9)
    MISMATCHes, and its verdict, report, JSON and figure say where."""
    require_devices(DEVICES)
    result = harness.check(batchnorm.MOMENTUM_SLIP, devices=DEVICES, steps_per_call=1, calls=1)
    loc = result.verdict.location
    assert result.verdict.kind is Finding.STATE and loc is not None
    assert (loc.kind, loc.legacy, loc.new) == ('statistics', 'BatchNorm_0', 'norm'), loc.line()
    assert loc.reading['momentum'] == pytest.approx((0.9, 0.1), abs=5e-5), loc.line()  # each side's, implied
    agree(loc)
    text = render.text(result, 'cpu', verbose=True).splitlines()
    assert text[text.index(f'diagnosis (state): {words.diagnosis(result.verdict.diagnosis)}') + 1].startswith(
        'where: statistics at BatchNorm_0 ↔ norm: '
    )
    assert render.to_json(result, {})['verdict']['location']['new'] == 'norm'
    written = plots.write(result, str(tmp_path))
    assert os.path.basename(written[-1]) == 'location.png' and os.path.getsize(written[-1]) > 0


# -- controls ------------------------------------------------------------------------------------


def test_a_correct_port_is_located_nowhere_and_every_module_agrees():
    loc = located('correct')
    assert loc.kind == 'none' and loc.first is None, loc.line()
    agree(loc)
    assert {m.legacy for m in loc.modules} == {'Dense_0', 'LayerNorm_0', 'Dropout_0', 'Dense_1', locate.ROOT}


def test_a_forward_it_cannot_see_is_said_and_not_guessed():
    """The NNX step calls a jitted function, no module: the loss parts, and the location says it
    cannot say where (never a module it did not observe)."""
    loc = located('opaque')
    assert loc.why is Unplaced.UNOBSERVED, loc.line()
    assert any(n.startswith('not observed: the new step called no flax module') for n in loc.notes)
    assert not loc.modules


def test_a_match_gets_no_location_unless_asked():
    """Nothing is run or added on MATCH by default; --locate asks (its flag, validated only); a run whose
    verdict only feeds another (the masked-loss hint's run on 1 device) is never located."""
    matched = rule.Verdict(Outcome.MATCH, 'measured')
    config = RunConfig(devices=DEVICES, batch_size=64)
    assert locate.attach(matched, kinds.of(my_port.MODEL), config, None, None) is matched
    args = ['--workload', 'mlp', '--devices', str(DEVICES), '--locate']
    assert run_command.inputs(args, n_available=DEVICES)[2].locate is True
    assert run_command.inputs(args[:-1], n_available=DEVICES)[2].locate is None  # on MISMATCH only
    assert locate.attach(dataclasses.replace(matched, outcome=Outcome.MISMATCH), kinds.of(my_port.MODEL),
                         dataclasses.replace(config, locate=False), None, None).location is None  # fmt: skip


@pytest.mark.parametrize(
    'eps, decay, nesterov, says',
    [
        (1e-8, 1e-2, False, 'a difference of -2.97e-05 x the parameter'),  # lr x (1e-4 - 1e-2)
        (1e-6, 1e-4, False, "an adaptive optimizer's eps, about 1e-08 on the pmap side, 1e-06 in NNX"),
        (1e-8, 1e-4, True, 'what nesterov gives Adam'),
    ],
)
def test_what_an_adam_first_update_implies(eps, decay, nesterov, says):
    """``implied.update`` on Adam's first step written out (``lr (g s / (|g| + eps) + decay p)``)."""
    rng = np.random.default_rng(0)
    g, p0, lr = rng.normal(size=1000) * np.logspace(-4, -1, 1000), rng.normal(size=1000), 3e-3
    step = lambda e, wd, s=1.0: -lr * (g * s / (np.abs(g) + e) + wd * p0)  # noqa: E731
    first = (1 + 2 * 0.9) / (1 + 0.9) if nesterov else 1.0
    assert says in implied.update(p0, step(1e-8, 1e-4), step(eps, decay, first), g, False)[0]


@pytest.mark.parametrize(
    'eps, decay, says, not_said',
    [
        (1e-6, 1e-4, 'hold earlier gradients too: what they imply is not read', r'\beps\b'),
        (1e-8, 1e-2, 'a difference of -2.97e-05 x the parameter', r'\beps\b'),
    ],
)
def test_what_a_later_adam_update_implies_leaves_eps_unread(eps, decay, says, not_said):
    """Step 2 of Adam from zero moments (a warmup's zero first update hid the slip until then): the update
    is no longer one gradient's ``g / (|g| + eps)``, so no eps is read from it, nor ruled out (VDM's eps 1e-6
    for 1e-8 read 'not one step factor, weight decay or eps alone'); a decoupled weight decay still reads."""
    rng = np.random.default_rng(0)
    g1, g2 = (rng.normal(size=1000) * np.logspace(-4, -1, 1000) for _ in range(2))
    p0, lr, b1, b2 = rng.normal(size=1000), 3e-3, 0.9, 0.999
    m, v = b1 * (1 - b1) * g1 + (1 - b1) * g2, b2 * (1 - b2) * g1**2 + (1 - b2) * g2**2
    step = lambda e, wd: -lr * (m / (1 - b1**2) / (np.sqrt(v / (1 - b2**2)) + e) + wd * p0)  # noqa: E731
    said = implied.update(p0, step(1e-8, 1e-4), step(eps, decay), g2, False, step=2)[0]
    assert says in said and not re.search(not_said, said), said


def test_a_gradient_scale_under_adam_is_said_as_one_not_as_an_eps():
    """Every gradient scaled by 2 on one side under Adam (google/mipnerf's clip by global norm 0.1 for 0.05, tried
    blind): the first moments part by 2 and the first update reads as an eps 2 x smaller; ``gradient_scale`` names the
    one cause that gives both. The controls: an eps slip (the moments agree, so no factor) and a b1 slip (the moments
    part by a factor, the bias-corrected first update does not) are not a gradient scale."""
    rng = np.random.default_rng(0)
    g, p0, lr = rng.normal(size=1000) * np.logspace(-4, -1, 1000), rng.normal(size=1000), 3e-3
    adam = lambda grads, eps=1e-8: -lr * grads / (np.abs(grads) + eps)  # noqa: E731 -- Adam's first step from 0
    mu = lambda grads, b1=0.9: {'w': (1 - b1) * grads}  # noqa: E731
    moments = lambda old, new: implied.moments('mu', {k: (old[k], new[k], 1e-12) for k in old})  # noqa: E731
    scaled = implied.update(p0, adam(g), adam(2 * g), g, True)[1]
    assert slots.gradient_scale('mu', moments(mu(g), mu(2 * g)), scaled) == pytest.approx(2, rel=1e-6)
    assert slots.gradient_scale('nu', moments(mu(g), mu(2 * g)), scaled) is None  # a second moment: not this rule
    eps = implied.update(p0, adam(g), adam(g, 5e-9), g, True)[1]
    assert dict(eps)['update'] == 'eps' and moments(mu(g), mu(g)) is None  # an eps alone moves no first moment
    assert slots.gradient_scale('mu', None, eps) is None
    assert slots.gradient_scale('mu', moments(mu(g), mu(3 * g)), scaled) is None  # factors that do not agree
    b1 = implied.update(p0, adam(g), adam(g), g, True)[1]
    assert slots.gradient_scale('mu', moments(mu(g), mu(g, 0.8)), b1) is None


def test_a_decay_mask_that_differs_either_way_is_read_as_such():
    """A decoupled weight decay on one kind of leaf only, on one side: the kernels (where_ports' decay after the
    learning rate), or the biases and scales as well (lm1b's port tried blind read 'not one step factor or weight
    decay alone'); a decay on every leaf is the plain decoupled decay (the control)."""
    rng = np.random.default_rng(1)
    p0, u = rng.normal(size=400), rng.normal(size=400) * 1e-3
    kernels = np.arange(400) < 300
    for decayed, what in ((kernels, 'on the kernels'), (~kernels, 'on the biases and scales'), (None, '')):
        d = -3e-4 * p0 * (decayed if decayed is not None else 1.0)
        said = implied.update(p0, u, u + d, None, False, kernels, step=2)[0]
        assert ('x the parameter ' + what if what else 'a decoupled weight decay') in said, said


def test_first_moments_read_a_clip_by_value_and_leave_one_factor_a_leaf_to_two_places():
    """Adam's first moment after one step, ``(1 - b1) g``, by leaf. A clip by value on one side leaves every
    element that parts at one magnitude there: the optimizer (``clipped``), not the gradients. One factor a
    leaf (VDM's stop_gradient on one parameter's jvp term: -11.9 on it, 1 elsewhere) is no finding of the
    optimizer (``uneven`` False, no factor): a per-leaf clip and gradients that differ give it alike (the
    locator then says not located); it was named 'update at opt_state mu/...'. The control: gradients that
    differ at random are ``uneven``, not clipped."""
    rng = np.random.default_rng(0)
    g = {'a': rng.normal(size=200), 'b': rng.normal(size=50)}
    mu = lambda grads: {k: 0.1 * v for k, v in grads.items()}  # noqa: E731
    held = lambda old, new: {k: (old[k], new[k], 1e-7) for k in old}  # noqa: E731
    clipped = implied.moments('mu', held(mu(g), mu({k: np.clip(v, -0.5, 0.5) for k, v in g.items()})))
    side, value = clipped.values()['clip']  # one magnitude on the new side: the clip value, (1 - b1) x 0.5
    assert clipped.clipped and clipped.uneven and side == 'new' and value == pytest.approx(0.05), clipped
    per_leaf = implied.moments('mu', held(mu(g), mu({'a': -11.9 * g['a'], 'b': g['b']})))
    assert per_leaf.factor is None and not per_leaf.uneven and not per_leaf.clipped, per_leaf
    noisy = implied.moments('mu', held(mu(g), mu({k: v + 0.3 * rng.normal(size=v.shape) for k, v in g.items()})))
    assert noisy.uneven and not noisy.clipped, noisy


def test_where_the_recording_cannot_run_the_probe_and_the_verdict_are_as_before(monkeypatch):
    """A port the recorded first steps cannot run: the gradient probe falls back on its plain
    programs, and the location says why there is none (no JAX program runs here)."""

    def cannot(*args, **kwargs):
        raise RuntimeError('recording refused')

    port, config = workloads.get('mlp'), RunConfig(devices=DEVICES, batch_size=64)
    kind, fed = kinds.of(port), made.make(port, config)
    probed = {side: types.SimpleNamespace(grads={'hidden/bias': np.zeros(3)}) for side in ('legacy', 'new', 'twin')}
    monkeypatch.setattr(recorded_run, 'first_steps', cannot)
    monkeypatch.setattr(probe, 'first_steps', lambda *args: probed)
    assert first_step.grads(Recorder(kind, config, fed, None)) == {s: p.grads for s, p in probed.items()}
    mismatched = rule.Verdict(Outcome.MISMATCH, 'measured')
    mismatch = locate.attach(mismatched, kind, config, fed, Recorder(kind, config, fed, None))
    assert mismatch.location.why is Unplaced.RAISED
    assert mismatch.location.reading == {'raised': 'RuntimeError', 'message': 'recording refused'}


# -- on twins2: the sharded run's twin, and one that ran in a fresh process ---------------------------


def test_under_fsdp_the_twins_rows_are_put_back_before_they_are_compared():
    """A sharded run's twin (``twin.Reordered``) holds the batch's rows interleaved: its recorded values,
    put back in the run's row order, measure floors of rounding size, and the gelu slip is located where
    it is at D = 2. Left as the twin held them (checked by hand, at D = 2 and 4), the floors are of the
    activations' size and the same slip is misnamed 'loss'."""
    require_devices(DEVICES)
    port = my_port.MODEL_GELU_SLIP
    config = RunConfig(workload='gelu', devices=DEVICES, steps_per_call=1, calls=1, batch_size=port.default_batch,
                       strategy='fsdp')  # fmt: skip
    kind, fed = kinds.of(port), made.make(port, config)
    recorder = Recorder(kind, config, fed, model_side.Reordered('fsdp'))
    loc = locate.locate(kind, config, fed, recorder)
    assert (loc.kind, loc.legacy, loc.new) == ('between', 'LayerNorm_0 → Dropout_0', 'norm → drop'), loc.line()
    first(loc)
    assert all(m.output_floor is not None and m.output_floor < 1e-5 for m in loc.modules), loc.modules
    assert 'twin' in recorder.runs[1]


def test_a_twin_that_ran_in_a_fresh_process_is_not_run_again_for_the_location():
    """Code pinned to its own mesh raises on the twin's; the verdict ran that twin in a fresh process
    (``twin.Measured.fresh``), and the recorded first steps run without it (no JAX program here)."""
    config = RunConfig(devices=DEVICES, batch_size=64)
    assert first_step.here(1, config) == 1 and first_step.here(None, config) is None
    assert first_step.here(1, config, fresh=(1,)) is None
    assert first_step.here(10**6, config) is None  # more devices than this process sees


def test_unpaired_module_calls_are_a_note_not_an_error():
    """A linen call with no NNX call paired to it is said in a note (the ViT example's slips raised
    KeyError: 'nnx' here, and their location was 'unlocated')."""
    raw = {'legacy': {'Dense_0': None, 'Dropout_0': None}, 'new': {'fc': None}}
    notes = locate._notes(types.SimpleNamespace(first_step_probe=lambda: print), raw, {'Dense_0': 'fc'}, True)
    said = [note.text for note in notes if note.tag == locate.UNPAIRED]
    assert said == ['1 of 2 linen module calls paired with new ones (1 recorded); not paired: Dropout_0'], said


def test_a_later_step_that_starts_from_parameters_apart_names_no_module(monkeypatch):
    """A module's output that parts on step k > 1 is evidence against the module only where both sides start
    step k from the same parameters: lm1b's Adam eps, tried blind, parted the embedding's own weights by
    3.1e-05 after step 2 (within their floors), and step 3 was 'module at Embed_0 ... (nothing parts before
    it)'. Parameters apart by any amount: not located, with the leaf and its gap; the same, bit for bit (a
    warmup's zero first update): the module stands (the control)."""
    found = location.Location('module', 'Embed_0', 'embed', 'its output parts')
    monkeypatch.setattr(locate, 'STAGES', (('forward', lambda step: found),))
    kind = types.SimpleNamespace(
        first_step_probe=lambda: print, port=types.SimpleNamespace(names=None, legacy_groups=None)
    )

    def judged(apart: float):
        before = {'embed/embedding': np.ones((4, 2), np.float32)}
        moved = {'embed/embedding': np.ones((4, 2), np.float32) + np.float32(apart)}
        results = {side: types.SimpleNamespace(params_per_call=[p, p]) for side, p in (('legacy', before),
                                                                                      ('new', moved))}  # fmt: skip
        return locate.judge_step(kind, results, {}, {}, {}, at=3, allowed=frozenset({'forward'}))

    apart = judged(3e-5)
    read = apart.reading
    assert apart.why is Unplaced.STARTS_APART and read['leaf'] == 'embed/embedding', apart.figures
    assert read['apart'] == pytest.approx(3e-5, rel=2e-3), apart.figures
    # it names no module as where it parts (issue 60: 'on step 8 module at bn1 parts' was no place), only its value
    assert read['parted'] == 'embed' and 'module at' not in apart.line(), apart.line()
    assert judged(0.0).kind == 'module'
