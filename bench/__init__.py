"""prefillq benchmarks: ratios measured side by side in one process, one JSON line each.

    python -m bench [--quick] [--json] [--model NAME]
"""
