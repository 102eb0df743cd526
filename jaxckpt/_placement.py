"""Chooses which processes hold the peer replicas of each process's memory tier.

Placement is a pure function of the failure-domain layout, so every process
computes the same answer without talking to the others.
"""

from collections.abc import Sequence


def place_replicas(domains: Sequence[str], replicas: int) -> tuple[tuple[int, ...], ...]:
    """Chooses the peers that hold copies of each process's data.

    The answer depends only on the arguments (never on hash seeds or on which
    process asks), so every process computes the same placement. Owners are
    served most-constrained first (processes of the largest domains), and each
    replica goes to the candidate that, in order of preference, lies in a
    failure domain this owner does not use yet, holds the fewest replicas so
    far, and comes soonest after the owner in process order (a rotation that
    spreads ties).

    Args:
      domains: ``domains[p]`` is the failure domain (for example the hostname)
        of process ``p``.
      replicas: How many copies of each process's data other processes hold.

    Returns:
      ``holders`` where ``holders[p]`` lists, in order of preference, the
      ``replicas`` distinct processes that hold copies of process ``p``'s data.
      None of them is ``p`` or shares ``p``'s failure domain.

    Raises:
      ValueError: If ``replicas`` is negative, or if some process has fewer than
        ``replicas`` processes outside its failure domain.
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ValueError(f"replicas must be a non-negative int, got {replicas!r}.")
    domains = list(domains)
    for p, domain in enumerate(domains):
        if not isinstance(domain, str) or not domain:
            raise ValueError(
                f"The failure domain of process {p} must be a non-empty str, got {domain!r}."
            )
    n = len(domains)
    if replicas == 0:
        return tuple(() for _ in range(n))

    # Dicts keep insertion order; sets of str would make the answer depend on
    # PYTHONHASHSEED and so differ between processes.
    members: dict[str, list[int]] = {}
    for p, domain in enumerate(domains):
        members.setdefault(domain, []).append(p)
    for domain, procs in members.items():
        outside = n - len(procs)
        if outside < replicas:
            raise ValueError(
                f"replicas={replicas} needs at least {replicas} processes outside failure "
                f"domain {domain!r} for process {procs[0]}, but only {outside} exist; "
                "lower TierOptions.replicas or spread processes over more failure domains."
            )

    load = [0] * n
    holders: list[tuple[int, ...]] = [()] * n
    # Most constrained owners first: a process in a big domain has few
    # candidates, so it chooses before the others have filled them up.
    order = sorted(range(n), key=lambda p: (-len(members[domains[p]]), p))
    for owner in order:
        own_domain = domains[owner]
        used: dict[str, int] = {}
        chosen: list[int] = []
        candidates = [c for c in range(n) if domains[c] != own_domain]
        for _ in range(replicas):
            best = min(
                (c for c in candidates if c not in chosen),
                key=lambda c: (load[c], used.get(domains[c], 0), (c - owner) % n),
            )
            chosen.append(best)
            load[best] += 1
            used[domains[best]] = used.get(domains[best], 0) + 1
        holders[owner] = tuple(chosen)
    return tuple(holders)
