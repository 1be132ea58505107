"""Quantile normalization, the robot contract and its transforms, and the Preprocessor
(preprocess/normalize.py, transforms.py, pipeline.py)."""
import numpy as np
import pytest
import torch

from molmobot_policy.model.config import MolmoBotConfig, NormStats
from molmobot_policy.preprocess.normalize import QuantileNormalizer, normalizers_from_config
from molmobot_policy.preprocess.images import resize_and_patchify
from molmobot_policy.preprocess.pipeline import Preprocessor
from molmobot_policy.preprocess.tokenizer import tiny_tokenizer
from molmobot_policy.preprocess.transforms import RobotContract, RobotTransforms
from molmobot_policy.types import Observation

TINY = MolmoBotConfig.from_name('tiny')
JOINTS = [f'j{i}' for i in range(8)]


def contract(**kwargs) -> RobotContract:
    args = dict(camera_names=['front', 'wrist'], joint_names=JOINTS)
    args.update(kwargs)
    return RobotContract(**args)


def transforms(**kwargs) -> RobotTransforms:
    return RobotTransforms(contract(**kwargs), TINY)


# ---------------------------------------------------------------- QuantileNormalizer
def test_normalize_maps_q01_to_minus_one_and_q99_to_plus_one():
    norm = QuantileNormalizer([0.0, -2.0], [4.0, 2.0])
    np.testing.assert_array_equal(norm.normalize([0.0, -2.0]), [-1.0, -1.0])
    np.testing.assert_array_equal(norm.normalize([4.0, 2.0]), [1.0, 1.0])
    np.testing.assert_array_equal(norm.normalize([2.0, 0.0]), [0.0, 0.0])


def test_normalize_does_not_clip():
    norm = QuantileNormalizer([0.0], [1.0])
    np.testing.assert_array_equal(norm.normalize([3.0]), [5.0])
    np.testing.assert_array_equal(norm.unnormalize([-3.0]), [-1.0])


def test_normalize_floors_a_zero_range_at_1e_minus_6():
    norm = QuantileNormalizer([0.0], [0.0])
    np.testing.assert_allclose(norm.normalize([1e-6]), [1.0], rtol=1e-5)
    np.testing.assert_array_equal(norm.normalize([0.0]), [-1.0])


def test_normalize_returns_float32_and_broadcasts_leading_dims():
    norm = QuantileNormalizer([0.0, 0.0], [1.0, 2.0])
    out = norm.normalize(np.ones((3, 4, 2), np.float64))
    assert out.dtype == np.float32 and out.shape == (3, 4, 2)


def test_unnormalize_inverts_normalize():
    rng = np.random.default_rng(0)
    q01 = rng.uniform(-3, 0, 8)
    q99 = q01 + rng.uniform(0.1, 5, 8)
    norm = QuantileNormalizer(q01, q99)
    x = rng.uniform(-4, 4, (16, 8)).astype(np.float32)
    np.testing.assert_allclose(norm.unnormalize(norm.normalize(x)), x, rtol=1e-6, atol=1e-6)


def test_normalizer_rejects_wrong_dimension():
    norm = QuantileNormalizer([0.0, 0.0], [1.0, 1.0], name='state')
    with pytest.raises(ValueError, match='2 values.*state.*shape \\(3,\\)'):
        norm.normalize([1.0, 2.0, 3.0])


def test_normalizer_rejects_mismatched_or_bad_statistics():
    with pytest.raises(ValueError, match='q01 has 2 entries but q99 has 3'):
        QuantileNormalizer([0.0, 0.0], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match='finite'):
        QuantileNormalizer([0.0, np.nan], [1.0, 1.0])
    with pytest.raises(ValueError, match='non-empty'):
        QuantileNormalizer([], [])


def test_normalizers_from_config_checks_widths_against_the_model():
    bad = TINY.replace(state_dim=7)
    with pytest.raises(ValueError, match='state statistics have 8 entries.*state_dim is 7'):
        normalizers_from_config(bad)
    with pytest.raises(ValueError, match='no norm_stats'):
        normalizers_from_config(TINY.replace(norm_stats=None))
    stats = NormStats([0.0] * 8, [1.0] * 8, [0.0] * 8, [1.0] * 8, mode='mean_std')
    with pytest.raises(ValueError, match="'quantiles'"):
        normalizers_from_config(TINY.replace(norm_stats=stats))


# ---------------------------------------------------------------- RobotContract
def test_contract_fields_are_tuples_and_action_joints_default_to_the_joints():
    c = contract(camera_names=['front', 'wrist'], joint_names=['a', 'b'])
    assert c.camera_names == ('front', 'wrist') and c.action_joint_names == ('a', 'b')


def test_numbered_contract_names_its_cameras_and_joints():
    c = RobotContract.numbered(3, 2, gripper_index=1)
    assert c.camera_names == ('camera_0', 'camera_1', 'camera_2')
    assert c.joint_names == c.action_joint_names == ('joint_0', 'joint_1')
    assert c.gripper_index == 1


def test_state_is_zero_padded_to_model_width_in_normalized_space():
    t = transforms(joint_names=['a', 'b'])
    q01, q99 = np.float32(TINY.norm_stats.state_q01), np.float32(TINY.norm_stats.state_q99)
    normalized = t.normalize_state([q01[0], q99[1]])
    assert normalized.shape == (TINY.state_dim,)
    np.testing.assert_allclose(normalized[:2], [-1.0, 1.0], atol=1e-6)
    np.testing.assert_array_equal(normalized[2:], 0.0)


def test_state_of_another_length_or_not_finite_is_an_error():
    t = transforms(joint_names=['a', 'b'])
    with pytest.raises(ValueError, match=r"shape \(2,\) for joints \['a', 'b'\]"):
        t.normalize_state([0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match='non-finite'):
        t.normalize_state([0.0, np.inf])


def test_more_joints_than_state_width_is_an_error():
    with pytest.raises(ValueError, match='joint_names has 9 joints.*state_dim=8'):
        contract(joint_names=[f'j{i}' for i in range(9)]).check(TINY)


@pytest.mark.parametrize('cameras', [['a'], ['a', 'b', 'c']])
def test_camera_count_outside_2_to_max_images_is_an_error(cameras):
    cfg = TINY.replace(max_images=2)
    with pytest.raises(ValueError, match=f'{len(cameras)} cameras? .*max_images=2'):
        contract(camera_names=cameras).check(cfg)


def test_duplicate_or_empty_names_are_an_error():
    with pytest.raises(ValueError, match=r"\['j0'\] appear more than once"):
        contract(joint_names=['j0', 'j0'])
    with pytest.raises(ValueError, match='camera_names is empty'):
        contract(camera_names=[])
    with pytest.raises(TypeError, match='string'):
        contract(joint_names='j0')


def test_observation_image_count_must_match_the_cameras():
    with pytest.raises(ValueError, match=r"3 images, the robot contract has 2 cameras "
                                         r"\['front', 'wrist'\]"):
        contract().check_camera_count(3)


def test_action_dims_map_to_action_joint_names_and_extra_dims_are_ignored():
    c = contract(action_joint_names=['a', 'b', 'c'])
    actions = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    np.testing.assert_array_equal(c.joint_positions(actions), actions[:, :3])
    with pytest.raises(ValueError, match=r'>= 3'):
        c.joint_positions(actions[:, :2])


def test_more_action_joints_than_action_dim_is_an_error():
    with pytest.raises(ValueError, match='action_joint_names has 9 joints.*action_dim=8'):
        contract(action_joint_names=[f'a{i}' for i in range(9)]).check(TINY)


def test_postprocess_unnormalizes_actions():
    q01 = np.float32(TINY.norm_stats.action_q01)
    q99 = np.float32(TINY.norm_stats.action_q99)
    out = transforms().postprocess(np.stack([-np.ones(8), np.ones(8)]).astype(np.float32))
    np.testing.assert_allclose(out, np.stack([q01, q99]), rtol=1e-6, atol=1e-6)


def test_gripper_threshold_binarizes_its_dimension_only():
    t = transforms(gripper_index=7, gripper_threshold=128.0, gripper_open=0.0,
                   gripper_closed=1.0)
    normalized = np.zeros((3, 8), np.float32)
    normalized[:, 7] = [-1.0, 0.0, 1.0]          # -> 0, 127.5, 255 on the gripper scale
    out = t.postprocess(normalized)
    np.testing.assert_array_equal(out[:, 7], [0.0, 0.0, 1.0])
    np.testing.assert_allclose(out[:, :7], t.action_normalizer.unnormalize(normalized)[:, :7])


@pytest.mark.parametrize('index', [8, -2])
def test_gripper_index_outside_action_dims_is_an_error(index):
    with pytest.raises(ValueError, match=rf'gripper_index={index} is not an action dimension'):
        contract(gripper_index=index).check(TINY)


ARM = [f'arm_j{i}' for i in range(1, 8)] + ['finger_joint']


def test_a_gripper_index_at_a_joint_not_named_like_a_gripper_is_warned_about():
    """gripper_index 6 (a slip for 7) binarizes arm_j7: WARN naming it and the index."""
    notes = contract(joint_names=ARM, gripper_index=6).notes(TINY)
    warns = [line for level, line in notes if level == 'WARN']
    assert len(warns) == 1 and "'arm_j7'" in warns[0] and 'gripper_index 6' in warns[0]
    assert any(level == 'INFO' and "'arm_j7' is commanded as a gripper" in line
               for level, line in notes)


def test_robotiqs_knuckle_joint_is_taken_for_a_gripper():
    """Robotiq 2F grippers' URDFs name the driven joint '..._left_knuckle_joint'."""
    joints = ARM[:7] + ['robotiq_85_left_knuckle_joint']
    notes = contract(joint_names=joints, gripper_index=7).notes(TINY)
    assert [level for level, _ in notes] == ['INFO'], notes


def test_a_gripper_index_at_a_gripper_joint_is_described_not_warned_about():
    notes = contract(joint_names=ARM, gripper_index=7, gripper_open=0.04,
                     gripper_closed=0.0).notes(TINY)
    assert [level for level, _ in notes] == ['INFO']
    assert "'finger_joint' is commanded as a gripper, 0.04 (open) or 0.0 (closed" in notes[0][1]


def test_fewer_joints_than_the_model_takes_are_noted_with_the_dimensions_padded_or_dropped():
    notes = dict((line.split(' ')[0], (level, line))
                 for level, line in contract(joint_names=ARM[:6]).notes(TINY))
    assert notes['joint_names'][0] == 'INFO' and 'state dimensions 6..7 are fed as 0' \
        in notes['joint_names'][1]
    assert 'action dimensions 6..7 are not published' in notes['action_joint_names'][1]
    assert contract(joint_names=ARM).notes(TINY) == []
    trained = contract(joint_names=ARM[:6]).notes(TINY, trained=True)   # a checkpoint's
    assert [level for level, _ in trained] == ['WARN', 'WARN']
    assert all(line.endswith('is a joint (e.g. the gripper) missing?') for _, line in trained)


def test_a_gripper_index_beyond_the_action_joints_is_warned_about():
    notes = contract(joint_names=ARM[:7], gripper_index=7).notes(TINY)
    assert ('WARN', 'gripper_index 7 is an action dimension no action joint receives '
                    '(action_joint_names has 7): no gripper command is published') in notes


def test_postprocess_rejects_wrong_action_width():
    with pytest.raises(ValueError, match=r'\(horizon, 8\)'):
        transforms().postprocess(np.zeros((16, 7), np.float32))


# ---------------------------------------------------------------- Preprocessor
@pytest.fixture(scope='module')
def preprocessor():
    return Preprocessor(TINY, tiny_tokenizer(TINY.tokens), contract())


def observation(n_images=2, state=None, instruction='pick up the cube'):
    rng = np.random.default_rng(1)
    images = tuple(rng.integers(0, 256, (24 + k, 32, 3), dtype=np.uint8) for k in range(n_images))
    state = np.zeros(8, np.float32) if state is None else state
    return Observation(images=images, state=state, instruction=instruction)


def test_preprocessor_builds_model_inputs_with_documented_shapes(preprocessor):
    inputs = preprocessor(observation())
    length = inputs.input_ids.shape[1]
    assert inputs.input_ids.dtype == torch.int64 and inputs.input_ids.shape == (1, length)
    assert inputs.attention_mask.dtype == torch.bool and inputs.attention_mask.all()
    assert inputs.images.dtype == torch.uint8 and inputs.images.shape == (1, 2, 729, 588)
    assert inputs.token_pooling.shape == (1, 2 * 196, 4)
    assert inputs.image_positions.shape == (1, 2 * 196)
    assert inputs.states.dtype == torch.float32 and inputs.states.shape == (1, 1, 8)
    assert (inputs.input_ids[0, inputs.image_positions[0]] == TINY.tokens.im_patch).all()
    assert set(inputs.tensors()) == {'input_ids', 'attention_mask', 'position_ids',
                                     'image_positions', 'token_pooling', 'images', 'states'}


def test_preprocessor_rejects_image_count_other_than_the_contract(preprocessor):
    with pytest.raises(ValueError, match='3 images.*2 cameras'):
        preprocessor(observation(n_images=3))


def test_preprocessor_names_the_camera_of_a_bad_image(preprocessor):
    obs = observation()
    bad = Observation(images=(obs.images[0], obs.images[1][..., 0]), state=obs.state,
                      instruction=obs.instruction)
    with pytest.raises(ValueError, match="camera 'wrist'"):
        preprocessor(bad)


def test_preprocessor_images_of_mixed_sizes_keep_camera_order_and_match_one_by_one():
    # the frames are grouped by size to be resized together: the result must still be in
    # camera order and equal to resizing each frame alone
    names = ['a', 'b', 'c', 'd']
    p = Preprocessor(TINY, tiny_tokenizer(TINY.tokens), contract(camera_names=names))
    rng = np.random.default_rng(2)
    shapes = [(24, 32, 3), (40, 30, 3), (24, 32, 3), (40, 30, 3)]
    frames = tuple(rng.integers(0, 256, shape, dtype=np.uint8) for shape in shapes)
    got = p.images(frames)
    assert got.shape == (1, 4, 729, 588) and got.dtype == torch.uint8
    for k, frame in enumerate(frames):
        np.testing.assert_array_equal(got[0, k].numpy(), resize_and_patchify(frame))


def test_preprocessor_refuses_a_batch_where_one_camera_frame_belongs(preprocessor):
    obs = observation()
    batch = np.stack([obs.images[0], obs.images[0]])
    bad = Observation(images=(obs.images[0], batch), state=obs.state,
                      instruction=obs.instruction)
    with pytest.raises(ValueError, match=r"camera 'wrist'.*\(H, W, 3\)"):
        preprocessor(bad)


def test_preprocessor_pads_the_prompt_to_its_bucket():
    p = Preprocessor(TINY, tiny_tokenizer(TINY.tokens), contract(), buckets=(512, 640))
    inputs = p(observation())
    length = inputs.text.length
    assert inputs.text.bucket == 512 and inputs.input_ids.shape == (1, 512)
    assert int(inputs.attention_mask.sum()) == length < 512
    assert (inputs.position_ids[0, length:] == length - 1).all()


def test_text_inputs_are_cached_per_instruction(preprocessor):
    first = preprocessor.text_inputs('open the drawer')
    assert preprocessor.text_inputs('open the drawer') is first
    assert preprocessor.text_inputs('close the drawer') is not first
    assert not first.input_ids.flags.writeable


def test_preprocessor_postprocess_returns_robot_units(preprocessor):
    out = preprocessor.postprocess(np.zeros((16, 8), np.float32))
    q01 = np.float32(TINY.norm_stats.action_q01)
    q99 = np.float32(TINY.norm_stats.action_q99)
    np.testing.assert_allclose(out, np.broadcast_to((q01 + q99) / 2, (16, 8)), atol=1e-5)
