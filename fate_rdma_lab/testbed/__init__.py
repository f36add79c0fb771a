"""The WAN testbed: sites as network namespaces joined by shaped links, with real packets."""
