"""oxygen_ros.engine: the OxyGen engine (one cycle per frame: prefill once -> actions -> admit -> batched decode ->
stream), its request/result types, decode budget, metrics and benchmark. Imports torch, never rclpy. Names are
resolved lazily so that importing the result types (``oxygen_ros.engine.requests``) stays cheap."""
_EXPORTS = {
    "Engine": "engine", "EngineConfig": "engine", "MODES": "engine",
    "ActionResult": "requests", "TokenEvent": "requests", "RequestResult": "requests", "LanguageRequest": "requests",
    "RTCRequest": "requests",
    "KINDS": "requests", "FixedK": "budget", "AdaptiveK": "budget", "make_budget": "budget", "Metrics": "metrics",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(name)
