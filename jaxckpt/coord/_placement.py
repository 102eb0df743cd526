"""Chooses which processes hold the peer replicas of each process's memory tier.

Placement is a pure function of the failure-domain layout, so every process
computes the same answer without talking to the others. It never places a
replica in its owner's failure domain, balances how many replicas each process
holds (memory on the holder's tmpfs), and, where balance allows, spreads each
owner's replicas over distinct domains.
"""

import collections
import math
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet


def place_replicas(
    domains: Sequence[str],
    replicas: int,
    preferred: Sequence[Sequence[int]] | None = None,
) -> tuple[tuple[int, ...], ...]:
    """Chooses the peers that hold copies of each process's data.

    With `preferred` (data-parallel layouts: ``preferred[p]`` lists the
    processes that hold the same shards as ``p`` in other replicas,
    `_replicas.partners`), each owner first takes, in that order, preferred
    processes outside its failure domain (at most one per domain, none above
    the lower bound on the busiest holder's load), and those choices are kept:
    a holder that already has the rest of the shard in memory makes a restart
    read nothing over the network. The remaining replicas are placed as below.

    The processes are laid out on a ring that interleaves the failure domains
    (largest domain first, round-robin), and each owner walks the ring from its
    own position, taking the first candidates outside its domain: first at most
    one per domain and none above the lower bound on the busiest holder's
    load, then relaxing those preferences in turn. When every domain has the
    same size this already gives each process exactly ``replicas`` replicas to
    hold. Otherwise load is then evened out by moving replicas along paths from
    the busiest holders to holders with at least two fewer, until no such path
    exists, which minimises the busiest holder's load.

    The answer depends only on the arguments (never on hash seeds or on which
    process asks), so every process computes the same placement.

    Args:
      domains: ``domains[p]`` is the failure domain (for example the hostname)
        of process ``p``.
      replicas: How many copies of each process's data other processes hold.
      preferred: ``preferred[p]``, the processes to take first as ``p``'s
        holders where the constraints allow (None: none preferred).

    Returns:
      ``holders`` where ``holders[p]`` lists the ``replicas`` distinct processes
      that hold copies of process ``p``'s data, none of them ``p`` or in ``p``'s
      failure domain.

    Raises:
      ValueError: If ``replicas`` is negative, a domain is not a non-empty
        string, or some process has fewer than ``replicas`` processes outside
        its failure domain.
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
    if replicas == 0 or n == 0:
        return tuple(() for _ in range(n))

    # IMPORTANT: dicts and lists only. Iterating a set of str depends on
    # PYTHONHASHSEED, which would give each process a different placement.
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

    # Every holder carries `replicas` on average, and the owners of a domain
    # of size s can only use the n - s processes outside it.
    load_bound = max(
        replicas, *(math.ceil(len(m) * replicas / (n - len(m))) for m in members.values())
    )
    groups = sorted(members.values(), key=lambda procs: (-len(procs), procs[0]))
    ring = [g[i] for i in range(len(groups[0])) for g in groups if i < len(g)]

    load = [0] * n
    holders: list[list[int]] = [[] for _ in range(n)]
    fixed: set[tuple[int, int]] = set()  # (owner, holder) pairs kept out of the balancing
    for owner, candidates in enumerate(preferred or ()):
        taken: set[str] = set()
        for c in candidates:
            if len(holders[owner]) == replicas:
                break
            if not 0 <= c < n or c == owner or c in holders[owner]:
                continue
            if domains[c] == domains[owner] or domains[c] in taken or load[c] >= load_bound:
                continue
            holders[owner].append(c)
            taken.add(domains[c])
            load[c] += 1
            fixed.add((owner, c))
    position_of = {p: i for i, p in enumerate(ring)}
    # Most constrained owners first: those in big domains have few candidates.
    for owner in sorted(ring, key=lambda p: -len(members[domains[p]])):
        position = position_of[owner]
        chosen = holders[owner]
        per_domain: collections.Counter[str] = collections.Counter(domains[c] for c in chosen)
        # (one replica per domain?, load limit), from strictest to none.
        for one_per_domain, limit in ((True, load_bound), (False, load_bound), (False, n)):
            for step in range(1, n):
                if len(chosen) == replicas:
                    break
                c = ring[(position + step) % n]
                if domains[c] == domains[owner] or c in chosen or load[c] >= limit:
                    continue
                if one_per_domain and per_domain[domains[c]]:
                    continue
                chosen.append(c)
                per_domain[domains[c]] += 1
                load[c] += 1
    _balance(domains, ring, holders, load, fixed)
    return tuple(tuple(h) for h in holders)


def _balance(
    domains: list[str],
    ring: list[int],
    holders: list[list[int]],
    load: list[int],
    fixed: AbstractSet[tuple[int, int]] = frozenset(),
) -> None:
    """Evens out holder loads in place by moving replicas along augmenting paths.

    A path starts at a holder with load ``level``, passes through holders with
    load ``level - 1`` and ends at one with at most ``level - 2``; each hop hands
    one owner's replica to the next holder. Applying it lowers the first holder
    by one, raises the last by one and leaves the others unchanged, so the sum
    of squared loads drops. When no path exists at any level, the loads are as
    even as the domain constraints allow (in particular the busiest holder
    holds as few replicas as possible).
    """
    held: list[list[int]] = [[] for _ in load]
    for owner, hs in enumerate(holders):
        for h in hs:
            if (owner, h) not in fixed:  # a preferred copy never moves
                held[h].append(owner)
    improved = True
    while improved:
        improved = False
        for level in range(max(load), min(load) + 1, -1):
            while _augment(level, domains, ring, holders, held, load):
                improved = True


def _augment(
    level: int,
    domains: list[str],
    ring: list[int],
    holders: list[list[int]],
    held: list[list[int]],
    load: list[int],
) -> bool:
    """Finds and applies one augmenting path from a holder at ``level``; False if none."""
    starts = [h for h in ring if load[h] == level]
    # Unvisited holders below `level`, by domain, so an owner skips its own
    # domain in one step instead of one holder at a time.
    free: dict[str, list[int]] = {}
    for h in ring:
        if load[h] < level:
            free.setdefault(domains[h], []).append(h)
    came_from: dict[int, tuple[int, int] | None] = dict.fromkeys(starts)
    queue = collections.deque(starts)
    while queue:
        h = queue.popleft()
        for owner in held[h]:
            for domain in list(free):
                if domain == domains[owner]:
                    continue
                kept = []
                for h2 in free.pop(domain):
                    if h2 in holders[owner] or h2 in came_from:
                        kept.append(h2)
                        continue
                    came_from[h2] = (h, owner)
                    if load[h2] <= level - 2:
                        _apply(h2, came_from, holders, held, load)
                        return True
                    queue.append(h2)
                if kept:
                    free[domain] = kept
    return False


def _apply(
    end: int,
    came_from: dict[int, tuple[int, int] | None],
    holders: list[list[int]],
    held: list[list[int]],
    load: list[int],
) -> None:
    """Moves one replica along each hop of the path that ends at ``end``."""
    load[end] += 1
    h2 = end
    while (hop := came_from[h2]) is not None:
        h, owner = hop
        holders[owner][holders[owner].index(h)] = h2
        held[h].remove(owner)
        held[h2].append(owner)
        h2 = h
    load[h2] -= 1


def partner_holders(
    owner: int,
    partners: Sequence[int],
    domain_of: Callable[[int], str],
    placed: Sequence[int],
    replicas: int,
    process_count: int,
) -> tuple[int, ...]:
    """One owner's holders in a data-parallel layout, from what that owner knows (pure).

    Its `partners` (the processes holding the same shards in other replicas,
    `_replicas.partners`) come first, tried in ring order after the owner so that
    where every process is a partner (a replicated leaf) the copies spread evenly,
    each taken only in a failure domain of its own outside the owner's; the
    holders `placed` at the run's set-up fill the rest, those in unused domains
    first. Every process computes its own holders alike from the same inputs;
    no process needs every domain.

    Args:
      owner: the process whose copies are placed.
      partners: its partners.
      domain_of: a process's failure domain (the owner's included).
      placed: the owner's holders as the set-up placed them (`place_replicas`).
      replicas: how many holders to choose.
      process_count: how many processes there are (the ring's size).

    Returns:
      At most `replicas` distinct holders, none of them the owner.
    """
    count = max(process_count, owner + 1, *(q + 1 for q in partners))
    chosen: list[int] = []
    used = {domain_of(owner)}
    for q in sorted(partners, key=lambda q: (q - owner) % count):
        domain = domain_of(q)
        if len(chosen) < replicas and q != owner and domain not in used:
            chosen.append(q)
            used.add(domain)
    rest = [h for h in placed if h not in chosen and h != owner]
    spread = [h for h in rest if domain_of(h) not in used]
    chosen += [*spread, *(h for h in rest if h not in spread)][: max(0, replicas - len(chosen))]
    return tuple(chosen)
