"""
The BayesianNet fast path's kept readings (issue 24): what a step of the recipe reads that does
not change from step to step (the guide's tensors in the param store, the model's own step, the
guide served) is read once and kept while a guard by identity holds; anything else falls back to
the full reading, whose checks and registrations then fire as before. Each test changes one thing
between steady steps and compares with the full reading (the kept reading dropped: the reference
run) or with the refusal the full reading makes.
"""

import cProfile
import pstats
import warnings

import pytest
import torch
from torch import nn

import pyro
from pyro import poutine
from pyro.distributions import constraints
from pyro.infer import SVI

from pyro_ngvi import NGVI, BayesianNet, CurvatureELBO


pytestmark = pytest.mark.usefixtures("one_thread")


def _net(likelihood, activation, widths, n, seed):
    """A fresh param store, an MLP ``widths`` as a BayesianNet, inputs and their generator."""
    pyro.clear_param_store()
    torch.manual_seed(seed)
    bnn = BayesianNet(nn.Sequential(nn.Linear(widths[0], widths[1]), activation, nn.Linear(widths[1], widths[2])),
                      likelihood, num_data=n)
    generator = torch.Generator().manual_seed(seed)
    return bnn, torch.randn(n, widths[0], generator=generator), generator


def _recipe(source="reparam", widths=(8, 16, 3), n=256, seed=0):
    bnn, x, generator = _net("categorical", nn.ReLU(), widths, n, seed)
    y = (x @ torch.randn(widths[0], widths[-1], generator=generator)).argmax(-1)
    return SVI(bnn, bnn.guide(), NGVI(), CurvatureELBO(source)), bnn, x, y


def _steps(svi, x, y, steps, before=None, at=None):
    """``steps`` steps on batches of 64; ``before(step)`` called before step ``at``."""
    losses = []
    with pyro.validation_enabled(False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            if step == at:
                before()
            losses.append(svi.step(x[(step * 64) % 192:][:64], y[(step * 64) % 192:][:64]))
    return losses, {name: value.detach().clone() for name, value in pyro.get_param_store().items()}


def _calls_per_step(svi, x, y) -> float:
    """Python/C calls of a steady step (after 5 warm-up steps; the mean over 5, cProfile's count)."""
    with pyro.validation_enabled(False):
        for _ in range(5):
            svi.step(x, y)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(5):
            svi.step(x, y)
        profiler.disable()
    return sum(v[1] for v in pstats.Stats(profiler).stats.values()) / 5


def _changed_then_stepped(change, forget: bool, steps=8, at=5):
    """The recipe with ``change(bnn)`` made between steady steps; ``forget``: the fast path's kept
    reading of the guide dropped too (the full reading: the reference)."""
    svi, bnn, x, y = _recipe()

    def before():
        change(bnn)
        if forget:
            bnn._fast_path._read = None
            bnn._fast_path._kept = None
    return _steps(svi, x, y, steps, before, at)


def _same(run, reference):
    (losses, params), (ref_losses, ref_params) = run, reference
    assert list(map(repr, losses)) == list(map(repr, ref_losses))
    assert params.keys() == ref_params.keys()
    for name, value in ref_params.items():
        assert torch.equal(params[name], value), name


def _replace_scale(bnn):
    store = pyro.get_param_store()
    name = "AutoNormal.scales." + bnn.latent_sites[0]
    store[name] = store[name].detach() * 3.0  # (a new tensor under the same name)


def test_a_scale_replaced_in_the_param_store_is_read_anew():
    # (kept: the old raw scale's sigma would draw the weights, losses differ from step 5 on)
    _same(_changed_then_stepped(_replace_scale, forget=False), _changed_then_stepped(_replace_scale, forget=True))


def test_a_param_store_cleared_between_steps_registers_the_guide_again():
    # (the guide's tensors registered anew as the full reading does; kept: a KeyError in the store)
    run = _changed_then_stepped(lambda bnn: pyro.clear_param_store(), forget=False)
    _same(run, _changed_then_stepped(lambda bnn: pyro.clear_param_store(), forget=True))
    assert len(run[1]) == 2 * 4


def test_a_loc_reshaped_in_place_is_refused_as_the_full_reading_refuses_it():
    def reshape(bnn):
        store = pyro.get_param_store()
        store._params["AutoNormal.locs." + bnn.latent_sites[0]].data = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="a guide of another model"):
        _changed_then_stepped(reshape, forget=False)


def test_a_changed_source_or_antithetic_takes_the_path_it_names():
    # (the ELBO keeps the model's own step per source: 'hessian' is the traced path's, not the net's)
    svi, bnn, x, y = _recipe("ef")

    def to_hessian():
        svi.loss_and_grads.__self__.curvature = "hessian"
    losses, _ = _steps(svi, x, y, 7, to_hessian, at=4)
    assert all(torch.isfinite(torch.tensor(losses)))
    svi, bnn, x, y = _recipe("reparam")
    fast = []
    elbo = svi.loss_and_grads.__self__

    class Counted:  # (the net's fast path, its calls counted)
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, *args, **kwargs):
            fast.append(1)
            return self.inner(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    def antithetic():
        elbo.antithetic = True  # (pairs of draws: the traced path's only)
        bnn._fast_path = Counted(bnn._fast_path)
    losses, _ = _steps(svi, x, y, 7, antithetic, at=4)
    assert fast == [] and all(torch.isfinite(torch.tensor(losses)))


def test_another_guide_of_the_same_net_takes_its_own_path():
    # (the ELBO keeps the model's own step per guide: a full-covariance guide is the traced path's)
    from pyro.infer.autoguide import AutoMultivariateNormal
    svi, bnn, x, y = _recipe()
    _steps(svi, x, y, 3)
    full = SVI(bnn, AutoMultivariateNormal(bnn), NGVI(), svi.loss_and_grads.__self__)
    with pyro.validation_enabled(False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.isfinite(torch.tensor([full.step(x[:64], y[:64]) for _ in range(2)])).all()


def test_the_guides_param_statements_reach_a_users_handler():
    # (pyro.param's message, as a handler around svi.step sees it: SVI's trace finds the locs by it)
    svi, bnn, x, y = _recipe()
    _steps(svi, x, y, 3)
    with pyro.validation_enabled(False), poutine.trace(param_only=True) as tape:
        svi.step(x[:64], y[:64])
    store = pyro.get_param_store()
    with poutine.trace(param_only=True) as reference:
        for site in bnn.latent_sites:
            pyro.param("AutoNormal.locs." + site)
    for name, expected in reference.trace.nodes.items():
        node = tape.trace.nodes[name]
        assert node["value"] is store._params[name]
        assert {k: v for k, v in node.items() if k != "value"} == {k: v for k, v in expected.items() if k != "value"}
        assert node["kwargs"] == {"constraint": constraints.real, "event_dim": None}


def test_a_second_net_through_the_same_elbo_steps_its_own_guide():
    # (the ELBO keeps the model's own step per model: the first net's would read the second's guide)
    svi, bnn, x, y = _recipe()
    _steps(svi, x, y, 3)
    pyro.clear_param_store()
    other = BayesianNet(nn.Sequential(nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 3)), "categorical", num_data=256)
    second = SVI(other, other.guide(), NGVI(), svi.loss_and_grads.__self__)  # (the same ELBO)
    with pyro.validation_enabled(False):
        second.step(x[:64], y[:64])
        before = {n: v.detach().clone() for n, v in pyro.get_param_store().items()}
        second.step(x[:64], y[:64])
    after = dict(pyro.get_param_store().items())
    assert {tuple(v.shape) for v in after.values()} == {(5, 8), (5,), (3, 5), (3,)}
    assert all(not torch.equal(after[n], v) for n, v in before.items())  # (every loc and scale stepped)


def test_the_same_guide_under_another_model_takes_that_models_path():
    # (the ELBO keeps the model's own step per model: a model wrapping the net has none, its traced
    # path runs the net inside it, which warns that its hints are lost; the net's own step would not)
    from pyro_ngvi.monitor import NGVIWarning
    svi, bnn, x, y = _recipe()
    _steps(svi, x, y, 3)
    outer = SVI(lambda xb, yb: bnn(xb, yb), svi.guide, svi.optim, svi.loss_and_grads.__self__)
    with pyro.validation_enabled(False), pytest.warns(NGVIWarning, match="inside another model"):
        outer.step(x[:64], y[:64])


# --------------------------------------------------------------------------- #
# The ELBO side's kept step (pyro_ngvi.nn.kept_step): each guard falls back to the full path
# --------------------------------------------------------------------------- #


def _kept_changed_then_stepped(change, forget: bool, source="reparam", steps=8, at=5):
    """``_changed_then_stepped`` for the kept step: ``forget`` drops it (and the kept reading) after
    ``change(svi, bnn)``, so the full path runs that step (the reference)."""
    svi, bnn, x, y = _recipe(source)

    def before():
        change(svi, bnn)
        if forget:
            bnn._fast_path._read = None
            bnn._fast_path._kept = None
    return _steps(svi, x, y, steps, before, at)


def _set(obj, name, value):
    return lambda svi, bnn: setattr(obj(svi, bnn), name, value)


@pytest.mark.parametrize("source, change", [
    # (each changes a decision the kept step holds; kept regardless, the step would differ)
    ("ggn", _set(lambda svi, bnn: svi.loss_and_grads.__self__, "curvature", "reparam")),  # the source
    ("reparam", _set(lambda svi, bnn: bnn, "num_data", 2000)),  # N, the scale N / B and the hints
    ("reparam", _set(lambda svi, bnn: bnn, "noise_limit", 0.05)),  # the noise floors handed over
    ("reparam", _set(lambda svi, bnn: bnn, "learn_prior", True)),  # the prior read at each step
    ("ggn_mc", _set(lambda svi, bnn: svi.loss_and_grads.__self__, "mc_samples", 3)),  # the sampled rows
    ("reparam", _set(lambda svi, bnn: svi.loss_and_grads.__self__, "num_particles", 2)),  # the particles
], ids=["source", "num_data", "noise_limit", "learn_prior", "mc_samples", "num_particles"])
def test_the_kept_step_falls_back_where_a_decision_changed(source, change):
    _same(_kept_changed_then_stepped(change, False, source), _kept_changed_then_stepped(change, True, source))


def test_the_kept_step_falls_back_for_a_batch_of_another_size():
    # (N / B of the last full step's batch would scale a batch of 40; the full path: exact)
    def run(forget):
        svi, bnn, x, y = _recipe("ggn")
        losses = []
        with pyro.validation_enabled(False):
            for step in range(6):
                if forget:
                    bnn._fast_path._kept = None
                size = 40 if step >= 4 else 64
                losses.append(svi.step(x[:size], y[:size]))
        return losses, {name: value.detach().clone() for name, value in pyro.get_param_store().items()}
    _same(run(False), run(True))


def test_a_weight_replaced_after_steady_steps_is_refused_as_the_full_path_refuses_it():
    # (a layer of the plain net replaced: the twin's plan, which ggn runs, still holds; the slots do not)
    def replace(svi, bnn):
        bnn.net[0] = nn.Linear(8, 16)
    with pytest.raises(ValueError, match="was replaced"):
        _kept_changed_then_stepped(replace, forget=False, source="ggn")


def test_a_hook_added_after_steady_steps_takes_the_hooked_pass():
    # (the closed-form plan refuses a net with a user's hook: the pass through the modules runs it)
    calls = []
    _kept_changed_then_stepped(lambda svi, bnn: bnn.net[0].register_forward_hook(lambda *a: calls.append(1)),
                               forget=False, steps=7)
    assert len(calls) == 2


def test_the_kept_step_checks_the_targets_values_under_validation():
    # (a class index out of range: the fast path refuses it as the likelihood's log_prob would)
    svi, bnn, x, y = _recipe("ggn")
    with pyro.validation_enabled(True), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            svi.step(x[:64], y[:64])
        bad = y[:64].clone()
        bad[5] = 3
        with pytest.raises(ValueError, match="class indices"):
            svi.step(x[:64], bad)


@pytest.mark.parametrize("source", ["ggn", "ef", "reparam"])
def test_a_steady_step_of_the_recipe_makes_at_most_300_python_calls(source):
    # (the main demo's MLP, digits' widths; 420-445 calls a step before the kept readings, 349-364 before
    # the ELBO's kept step)
    svi, bnn, x, y = _recipe(source, widths=(64, 100, 10), n=1437)
    assert _calls_per_step(svi, x[:128], y[:128]) <= 300


# --------------------------------------------------------------------------- #
# The kept step of the Gaussian likelihood (the regression recipe, its noise scale learned)
# --------------------------------------------------------------------------- #


def _gaussian_recipe(source="ggn", widths=(10, 16, 1), n=256, seed=0):
    bnn, x, generator = _net("gaussian", nn.Tanh(), widths, n, seed)
    y = torch.sin(x @ torch.randn(widths[0], generator=generator)) + 0.3 * torch.randn(n, generator=generator)
    return SVI(bnn, bnn.guide(), NGVI(), CurvatureELBO(source)), bnn, x, y


def _gaussian_run(source, changes, forget, steps=12):
    """The Gaussian recipe, ``changes[k](bnn)`` made before step ``k`` (a batch of ``sizes``); ``forget``:
    the kept step and reading dropped before every step (the full path throughout: the reference).
    Also which steps the kept step ran: the one run before the step is still there after it (a full
    step drops it and records another)."""
    svi, bnn, x, y = _gaussian_recipe(source)
    losses, kept_ran = [], []
    with pyro.validation_enabled(False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            size = changes.get(step, (None, 64))[1] if step in changes else (40 if step >= 10 else 64)
            if step in changes and changes[step][0] is not None:
                changes[step][0](bnn)
            if forget:
                bnn._fast_path._read = None
                bnn._fast_path._kept = None
            before = bnn._fast_path._kept
            losses.append(svi.step(x[(step * 64) % 192:][:size], y[(step * 64) % 192:][:size]))
            kept_ran.append(before is not None and bnn._fast_path._kept is before)
    params = {name: value.detach().clone() for name, value in pyro.get_param_store().items()}
    grads = {name: None if value.grad is None else value.grad.clone()
             for name, value in pyro.get_param_store()._params.items()}
    return (losses, params), grads, kept_ran


def _new_noise_scale(value, dtype=torch.float32):
    def change(bnn):  # (a new tensor under the same name: the kept step's begin reads it)
        pyro.get_param_store()["noise_scale"] = torch.tensor(value, dtype=dtype)
    return change


def _fixed_noise_scale(value):
    def change(bnn):
        bnn.noise_scale = value
    return change


@pytest.mark.parametrize("source", ["ggn", "ef", "reparam", "ggn_mc"])
def test_the_gaussian_recipe_keeps_its_steps_to_the_bit_with_the_noise_scale_replaced_or_fixed(source):
    # (the kept step runs the steps of a new noise-scale tensor, of a fixed scale and back, each as the
    # full path does; a noise scale or c = 1/(2 s^2) kept from the recorded step would differ from step 4 on)
    changes = {4: (_new_noise_scale(0.3), 64), 6: (_new_noise_scale(2.0, torch.float64), 64),
               7: (_fixed_noise_scale(0.5), 64), 9: (_fixed_noise_scale(None), 64)}
    run, grads, kept_ran = _gaussian_run(source, changes, forget=False)
    reference, reference_grads, _ = _gaussian_run(source, changes, forget=True)
    _same(run, reference)
    assert all(kept_ran[k] for k in (4, 6, 7, 9))  # (the kept step took each change itself)
    assert sum(kept_ran) >= 9
    for name, grad in reference_grads.items():  # (the learned scale's gradient, left by the last step)
        assert (grad is None) == (grads[name] is None) and (grad is None or torch.equal(grad, grads[name])), name


@pytest.mark.parametrize("change, step", [
    (lambda bnn: bnn.set_prior(0.3), 5),  # a prior set between steps: its precisions and log s_0
    (lambda bnn: setattr(bnn, "num_data", 1000), 5),  # N, the scale N / B and the hints
    (None, 10),  # a batch of 40 (from step 10 on): N / B, the events of the Gaussian's log s term
], ids=["set_prior", "num_data", "batch_size"])
def test_the_gaussian_kept_step_falls_back_where_a_decision_changed(change, step):
    changes = {step: (change, 64)} if change is not None else {}
    run, _, kept_ran = _gaussian_run("ggn", changes, forget=False)
    _same(run, _gaussian_run("ggn", changes, forget=True)[0])
    assert kept_ran[step - 1] and not kept_ran[step] and kept_ran[step + 1]  # (the full path, then kept anew)


def test_a_steady_step_of_the_gaussian_recipe_makes_at_most_560_python_calls():
    # (the regression recipe's MLP 10-50-1, batches of 64, the noise scale learned: 591 calls a step
    # before the ELBO's kept step took the Gaussian likelihood, 536 with it)
    svi, bnn, x, y = _gaussian_recipe("ggn", widths=(10, 50, 1), n=353)
    assert _calls_per_step(svi, x[:64], y[:64]) <= 560


@pytest.mark.parametrize("source", ["ggn", "reparam"])
def test_autocast_entered_between_steady_steps_takes_the_full_path(source):
    # (under torch.autocast the net's gradients come in bfloat16: the full path scales them by N/B = 1437/64,
    # not a bfloat16 number, as a 0-d bfloat16 tensor and makes the reparam curvature's buffers in bfloat16;
    # a kept step recorded outside autocast kept the float32 ones: ggn's loss at step 7 2022.917 vs 2022.852;
    # a step recorded under autocast is refused by the dtype of its factor, as before)
    def run(forget):
        svi, bnn, x, y = _recipe(source, n=1437)
        losses = []
        with pyro.validation_enabled(False), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in range(8):
                if forget:
                    bnn._fast_path._read = None
                    bnn._fast_path._kept = None
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=step >= 5):
                    losses.append(svi.step(x[(step * 64) % 192:][:64], y[(step * 64) % 192:][:64]))
        return losses, {name: value.detach().clone() for name, value in pyro.get_param_store().items()}
    _same(run(False), run(True))


@pytest.mark.parametrize("source", ["ggn", "reparam"])
def test_a_trained_net_pickles_and_its_copy_steps_as_the_original(source):
    # (the closed-form plans a step keeps hold the activations' functions: pickle.dumps(bnn) and
    # torch.save(bnn) raised PicklingError after the first step; a copy drops what steps rebuild)
    import copy as copy_module
    import io
    import pickle

    svi, bnn, x, y = _recipe(source)
    _steps(svi, x, y, 5)
    buffer = io.BytesIO()
    torch.save(bnn, buffer)
    copy = pickle.loads(pickle.dumps(bnn))
    assert torch.load(io.BytesIO(buffer.getvalue()), weights_only=False).state_dict().keys() == bnn.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(copy.state_dict().values(), bnn.state_dict().values()))
    saved = copy_module.deepcopy(pyro.get_param_store().get_state())
    state = svi.optim.get_state()
    torch.manual_seed(7)
    original, after = _steps(svi, x, y, 3)
    pyro.get_param_store().set_state(saved)  # (the same guide and optimizer state, the copy's net)
    svi.optim.set_state(state)
    torch.manual_seed(7)
    copied, after_copy = _steps(SVI(copy, svi.guide, svi.optim, svi.loss_and_grads.__self__), x, y, 3)
    assert copied == original
    assert all(torch.equal(after_copy[name], value) for name, value in after.items())
