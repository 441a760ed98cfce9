"""sensor_msgs/Image <-> numpy, for the node's camera callbacks and for the synthetic bags.

This file owns image conversion and validation.  ``image_to_rgb8(msg)`` turns any supported ``sensor_msgs/Image``
into a C-contiguous ``uint8`` RGB array ``[H, W, 3]``; it honours ``step`` (row padding), ``is_bigendian`` and the
standard encodings (rgb8, bgr8, rgba8, bgra8, mono8, rgb16, bgr16, rgba16, bgra16, mono16, 8UC1/3/4, 16UC1/3/4;
16-bit data is scaled by 255/65535 and rounded like OpenCV's ``convertTo``).  Bad messages raise ``ImageError`` whose
``reason`` is a short key used as a diagnostics counter (``encoding``, ``size``, ``step``, ``truncated``).  When the
ROS 2 ``cv_bridge`` is importable (a real ROS install) it is used for the encodings it supports and gives identical
arrays; the PyPI ``cv-bridge`` (ROS 1 code, broken with numpy 2) is detected and never used.  ``rgb_to_image``
builds messages (optionally padded rows / big-endian) for bags and tests.  Nothing here needs rclpy at import time:
messages are duck-typed (``height``, ``width``, ``encoding``, ``is_bigendian``, ``step``, ``data``).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

__all__ = ["ImageError", "image_to_rgb8", "validate_image", "image_to_rgb8_numpy", "rgb_to_image", "ENCODINGS",
           "have_cv_bridge",
           "MAX_DIMENSION"]

# Anything larger is treated as a corrupt header rather than a camera frame (protects against huge allocations).
MAX_DIMENSION = 16384


@dataclass(frozen=True)
class _Enc:
    channels: int
    itemsize: int          # bytes per channel value (1 or 2)
    order: str             # "rgb", "bgr", "rgba", "bgra", "mono"


ENCODINGS: dict[str, _Enc] = {
    "rgb8": _Enc(3, 1, "rgb"), "bgr8": _Enc(3, 1, "bgr"), "rgba8": _Enc(4, 1, "rgba"), "bgra8": _Enc(4, 1, "bgra"),
    "mono8": _Enc(1, 1, "mono"),
    "rgb16": _Enc(3, 2, "rgb"), "bgr16": _Enc(3, 2, "bgr"), "rgba16": _Enc(4, 2, "rgba"), "bgra16": _Enc(4, 2, "bgra"),
    "mono16": _Enc(1, 2, "mono"),
    # Generic OpenCV-style encodings: 1 channel = grey, 3 = BGR, 4 = BGRA (OpenCV's convention).
    "8UC1": _Enc(1, 1, "mono"), "8UC3": _Enc(3, 1, "bgr"), "8UC4": _Enc(4, 1, "bgra"),
    "16UC1": _Enc(1, 2, "mono"), "16UC3": _Enc(3, 2, "bgr"), "16UC4": _Enc(4, 2, "bgra"),
}

# Encodings the ROS 2 cv_bridge converts to rgb8 itself (it refuses the generic nUCm ones as "not a color format").
_CV_BRIDGE_ENCODINGS = {"rgb8", "bgr8", "rgba8", "bgra8", "mono8", "rgb16", "bgr16", "rgba16", "bgra16", "mono16"}


class ImageError(ValueError):
    """A camera message that cannot be converted; ``reason`` is a diagnostics counter key."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _load_cv_bridge():
    """Return a working ROS 2 CvBridge instance, or None.

    The PyPI ``cv-bridge`` 1.13 (ROS 1 code) imports but fails with numpy 2 and ignores ``step``, so instead of
    trusting the import, a padded 3x2 bgr8 image is converted once and must match the numpy path exactly.
    """
    try:
        import cv_bridge  # noqa: PLC0415
        bridge = cv_bridge.CvBridge()
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None

    try:
        rgb = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3) * 7
        msg = rgb_to_image(rgb, "bgr8", row_padding=5)
        got = np.asarray(bridge.imgmsg_to_cv2(msg, desired_encoding="rgb8"))
        if got.shape != rgb.shape or not np.array_equal(got, rgb):
            return None
    except Exception:  # noqa: BLE001
        return None
    return bridge


_BRIDGE = None
_BRIDGE_LOADED = False


def have_cv_bridge() -> bool:
    """True when the ROS 2 cv_bridge is importable and will be used."""
    global _BRIDGE, _BRIDGE_LOADED
    if not _BRIDGE_LOADED:
        _BRIDGE = _load_cv_bridge()
        _BRIDGE_LOADED = True
    return _BRIDGE is not None


def validate_image(msg) -> tuple[_Enc, int, int, int]:
    """Check a message's header fields against its data (cheap, no pixel access); raises ImageError."""
    enc_name = str(msg.encoding)
    enc = ENCODINGS.get(enc_name)
    if enc is None:
        raise ImageError("encoding", f"unsupported image encoding {enc_name!r} "
                                     f"(supported: {', '.join(sorted(ENCODINGS))})")
    h, w, step = int(msg.height), int(msg.width), int(msg.step)
    if h <= 0 or w <= 0:
        raise ImageError("size", f"image has zero size ({w}x{h})")
    if h > MAX_DIMENSION or w > MAX_DIMENSION:
        raise ImageError("size", f"image size {w}x{h} exceeds {MAX_DIMENSION} per side")
    row = w * enc.channels * enc.itemsize
    if step < row:
        raise ImageError("step", f"step {step} is smaller than width*channels*bytes = {row} ({enc_name}, width {w})")
    if step % enc.itemsize:
        raise ImageError("step", f"step {step} is not a multiple of the {enc.itemsize}-byte sample size")
    n = len(msg.data)
    if n < step * h:
        raise ImageError("truncated", f"image data has {n} bytes, expected step*height = {step * h}")
    if n > step * h:
        raise ImageError("size", f"image data has {n} bytes, more than step*height = {step * h} "
                                 f"(height/width do not match the data)")
    return enc, h, w, step


def _as_bytes(data) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return data.view(np.uint8).reshape(-1)
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    # rclpy gives array.array('B') for uint8[]; it supports the buffer protocol.
    try:
        return np.frombuffer(memoryview(data), dtype=np.uint8)
    except TypeError:
        return np.asarray(data, dtype=np.uint8)


def image_to_rgb8_numpy(msg) -> np.ndarray:
    """Convert with numpy only (the path used where the ROS 2 cv_bridge is not installed)."""
    enc, h, w, step = validate_image(msg)
    buf = _as_bytes(msg.data)[: step * h]
    rows = buf.reshape(h, step)[:, : w * enc.channels * enc.itemsize]
    if enc.itemsize == 1:
        px = rows.reshape(h, w, enc.channels)
    else:
        big = bool(msg.is_bigendian)
        dt = np.dtype(">u2" if big else "<u2")
        px16 = np.ascontiguousarray(rows).view(dt).reshape(h, w, enc.channels).astype(np.float64)
        px = np.clip(np.rint(px16 * (255.0 / 65535.0)), 0, 255).astype(np.uint8)
    if enc.order == "mono":
        out = np.repeat(px, 3, axis=2)
    elif enc.order == "rgb":
        out = px
    elif enc.order == "rgba":
        out = px[:, :, :3]
    elif enc.order == "bgr":
        out = px[:, :, ::-1]
    else:  # bgra
        out = px[:, :, 2::-1]
    return np.ascontiguousarray(out, dtype=np.uint8)


def image_to_rgb8(msg, use_cv_bridge: bool | None = None) -> np.ndarray:
    """Convert a sensor_msgs/Image to uint8 RGB [H, W, 3]; raises ImageError with a reason key.

    ``use_cv_bridge``: None = use the ROS 2 cv_bridge when installed (and the encoding is one it converts),
    False = numpy only, True = require cv_bridge (RuntimeError if absent).
    """
    if use_cv_bridge is False or (use_cv_bridge is None and not have_cv_bridge()):
        return image_to_rgb8_numpy(msg)
    if use_cv_bridge and not have_cv_bridge():
        raise RuntimeError("the ROS 2 cv_bridge is not installed")
    validate_image(msg)  # same reasons and messages on both paths
    if str(msg.encoding) not in _CV_BRIDGE_ENCODINGS:
        return image_to_rgb8_numpy(msg)
    try:
        arr = _BRIDGE.imgmsg_to_cv2(msg, desired_encoding="rgb8")
    except Exception as exc:  # noqa: BLE001 - cv_bridge raises CvBridgeError / cv2.error
        raise ImageError("encoding", f"cv_bridge could not convert {msg.encoding!r}: {exc}") from exc
    return np.ascontiguousarray(arr, dtype=np.uint8)


def rgb_to_image(rgb: np.ndarray, encoding: str = "rgb8", *, stamp=None, frame_id: str = "",
                 row_padding: int = 0, bigendian: bool = False, msg=None):
    """Build a sensor_msgs/Image from uint8 RGB [H, W, 3] in ``encoding`` (any key of ENCODINGS).

    ``row_padding`` extra bytes per row exercise ``step`` handling; ``bigendian`` applies to 16-bit encodings.
    ``msg``: an existing message object to fill (default: a new ``sensor_msgs.msg.Image``).  Returns the message.
    """
    rgb = np.asarray(rgb)
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected uint8 [H, W, 3], got {rgb.dtype} {rgb.shape}")
    enc = ENCODINGS[encoding]
    h, w, _ = rgb.shape
    if enc.order == "mono":
        # ITU-R 601 luma, like OpenCV's RGB2GRAY, rounded.
        y = np.rint(rgb[..., 0] * 0.299 + rgb[..., 1] * 0.587 + rgb[..., 2] * 0.114)
        px = np.clip(y, 0, 255).astype(np.uint8)[..., None]
    elif enc.order == "rgb":
        px = rgb
    elif enc.order == "bgr":
        px = rgb[..., ::-1]
    elif enc.order == "rgba":
        px = np.concatenate([rgb, np.full((h, w, 1), 255, np.uint8)], axis=2)
    else:
        px = np.concatenate([rgb[..., ::-1], np.full((h, w, 1), 255, np.uint8)], axis=2)
    if enc.itemsize == 2:
        px = (px.astype(np.uint16) * 257).astype(">u2" if bigendian else "<u2")
    row_bytes = np.ascontiguousarray(px).view(np.uint8).reshape(h, w * enc.channels * enc.itemsize)
    if row_padding:
        row_bytes = np.concatenate([row_bytes, np.zeros((h, row_padding), np.uint8)], axis=1)
    if msg is None:
        from sensor_msgs.msg import Image  # noqa: PLC0415 - only needed when building real messages
        msg = Image()
    header = getattr(msg, "header", None)
    if header is not None:
        if stamp is not None:
            header.stamp = stamp
        header.frame_id = frame_id
    msg.height, msg.width = h, w
    msg.encoding = encoding
    msg.is_bigendian = 1 if (bigendian and enc.itemsize == 2) else 0
    msg.step = row_bytes.shape[1]
    msg.data = row_bytes.tobytes()
    return msg


if __name__ == "__main__":  # pragma: no cover - tiny manual check
    print("cv_bridge (ROS 2):", have_cv_bridge(), file=sys.stderr)
