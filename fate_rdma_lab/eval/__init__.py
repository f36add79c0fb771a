"""The evaluation studies on the WAN testbed: links, FATE's own path, stress, fairness, system cost."""
