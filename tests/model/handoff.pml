/*
 * pdmesh's request path and KV handoff as a Promela model (Spin), at the level of
 * docs/DESIGN.md. `make verify` (tests/model/verify.py) explores its whole state space,
 * then removes one guard at a time (the variants below) and expects a counterexample
 * for each. By hand:
 *
 *   spin -a handoff.pml && gcc -O2 -DSAFETY -DNOCLAIM -DCOLLAPSE -o pan pan.c && ./pan -m100000
 *   spin -DCONF_RESUME -a handoff.pml && ...                # the other configuration
 *   spin -DNO_FENCE_WAIT -a handoff.pml && ...              # a variant
 *   gcc -O2 -DCOLLAPSE -DNFAIR=4 -o pan pan.c && ./pan -a -f   # I6, under weak fairness
 *
 * Requests: r0 and r1 fit the served context, r2 does not (the incident's prompt). Decode's
 * pool has two pages, so pages are leased again. Two configurations, each explored in full
 * (together they are one too large a space for CI: two complete request lifecycles side by
 * side are already 10^7 states):
 *   default       r0, r1 and r2 share the pool: r0's pages go to r1 and back, across
 *                 tenants; r1 is a well-behaved neighbour (never aborted, its reserve never
 *                 times out, its prefill never dies or misbehaves; decode's liveness check
 *                 still may end its lease at any point); r0 does not resume.
 *   CONF_RESUME   r0 resumes once on LOST with a new attempt under the same reservation id,
 *                 so its first attempt's late frames meet its second attempt's lease; r1
 *                 does not run. Page bytes are never zeroed on free (content[] keeps the
 * epoch whose bytes the page holds), so a read of a page this lease did not write sees
 * another epoch's bytes.
 *
 * Processes: Client(r) is the gateway's request and admission's handling of it (decide,
 * reserve with a timeout and ReserveCancel, dispatch, the stream, resume on LOST for r0);
 * Prefill(r, att, ep, n) is one prefill job, which may take any page from the KV tiers;
 * Receiver is decode's data-plane endpoint; Decode is decode's control loop over its pool;
 * Attacker sends one frame without the key.
 *
 * KV tiers: prefill's host memory, disk and remote store are one untrusted store of sealed
 * entries. An entry is whose KV it holds: the tenant whose per-salt key sealed it and the
 * prompt whose tokens it covers (KV(tenant, prompt)); r0 and r1 are different tenants. The
 * store holds one entry slot, and anyone may have written it since the last lookup: an
 * earlier prefill of the same tenant and prompt, another tenant's worker, a stale write,
 * an attacker without the tier key (an altered or forged entry, which no tenant's key
 * opens). So the model lets the store choose the entry at each lookup: none, the request's
 * own, another tenant's for the same tokens, or its own tenant's for other tokens. This
 * contains every history of puts and foreign writes and keeps the store out of the state.
 * A loaded page is marked written (readable by the remaining chunks, and sent to decode)
 * only once its check passed (the entry's tenant is the request's and its tokens are the
 * request's: the AEAD tag under the per-salt key and the header's token ids); a refused
 * entry is computed instead. Pages carry, besides their epoch, whose KV their bytes are.
 *
 * Faults: control messages (Abort, Release, ReserveCancel, the dispatch, reserve replies,
 * stream events) may be lost; each sender's messages arrive in order on its own link and
 * links interleave freely (NATS orders per publisher, no more); a prefill may die or be
 * cut off at any chunk (an abort it sees is the same step), or misbehave once (skip a page
 * while holding the key); decode's liveness check (heartbeat loss, progress stall) may
 * fire on any reservation not yet committed; a fence may end with a write in flight.
 *
 * Abstractions, each giving the protocol less than the code has (so what holds here holds
 * there): the reservation id is the request's index, reused by its resumed attempt (the
 * code's is a fresh UUID per reservation); the frame MAC is "a key holder of this
 * reservation id" (the code's key is fresh per reservation and bound to the epoch); the
 * receiver does not check page order or duplicates (the code does); a page holds a whole
 * request's worth of tokens; admission is modelled per request, so admissions of
 * different requests interleave freely. The tier check is only "this tenant, these tokens"
 * (the code also refuses another model, another geometry and entries older than the
 * tenant's purge), and the store may answer anything at any lookup; a loaded page stands
 * for the page's loaded prefix, whose tokens after it are computed on it.
 *
 * Variants (one guard removed each, selected with spin -D<NAME>):
 *   NO_REJECT_FIRST   admission reserves before it decides
 *   INCIDENT          a rejected prompt goes on as a 1-page stub into a full reservation
 *   NO_EPOCH_CHECK    the receiver takes a frame whatever its epoch
 *   NO_FRAME_MAC      the receiver takes a frame from a sender without the key
 *   NO_COVERAGE       the receiver accepts a commit whatever pages landed
 *   WRITTEN_EARLY     decode reads when prefill says it is done, not on the verified commit
 *   NO_FENCE_WAIT     fence returns with a write still in flight
 *   NO_QUARANTINE     a fence that ended with a write in flight frees the pages
 *   TELL_FIRST        decode tells the client before it frees (a failed publish leaks)
 *   RELEASE_TWICE     a late Abort frees a lease's pages again (release not idempotent)
 *   NO_TIER_CHECK     prefill copies a block it loaded from the tiers whatever its check said
 */

#define NREQ    3
#ifdef CONF_RESUME
#define RESUME   true    /* r0 resumes once on LOST; r1 does not run */
#define PLAIN(r) false
#else
#define RESUME   false   /* r0 and r1 share the pool; r1 is a well-behaved neighbour */
#define PLAIN(r) ((r) == 1)
#endif
#define NPAGES  2
#define CTX     1        /* served context, in pages */
#define NLINKS  4        /* data links: r0 attempt 0, r0 attempt 1, r1, r2 */
#define LINK(r, att) ((r) == 0 -> (att) : (r) + 1)

#define FREE    0
#define QUAR    254      /* quarantined: never leased again */
#define FOREIGN 253      /* bytes from a sender without the key */

/* whose KV a page's bytes are: the tenant whose key sealed them, the prompt whose tokens they
   cover. Request r is tenant r sending prompt r; OTHER is any other tenant or prompt. */
#define KV(tenant, prompt) ((tenant) * 4 + (prompt))
#define OTHER   3
#define MINE(r) KV(r, r)

mtype = { RESERVE, CANCEL,                          /* admission -> decode */
          RELEASE, DONE,                            /* prefill -> decode */
          ABORT,                                    /* gateway -> decode */
          FINISHED, FAILED, LOST,                   /* worker -> gateway (stream) */
          DATA, COMMIT };                           /* prefill -> decode (data plane) */

/* the decode record of a request (RequestState) */
#define S_NONE     0
#define S_RESERVED 1
#define S_WRITTEN  2     /* TRANSFERRED: commit verified, pages marked written */

byte need[NREQ];

/* decode's pool */
byte owner[NPAGES];      /* epoch of the lease holding the page, FREE or QUAR */
byte content[NPAGES];    /* epoch whose bytes the page holds (FREE: never written) */
bool own_kv[NPAGES];     /* and those bytes are the KV of that epoch's own request: its
                            tenant's and its prompt's (false: never written) */
byte next_epoch = 1;
byte leased = 0;         /* pages held by live leases */

/* decode's reservation of request r */
byte epoch[NREQ];        /* 0: no live lease */
byte att_of[NREQ];
byte state[NREQ];
byte pg[NREQ * 2];       /* the lease's pages (need <= 2) */
/* the receiver's expectation for r */
bool live[NREQ];
byte landed[NREQ];       /* bit i: page i of this epoch's transfer landed */
byte inflight[NREQ];     /* accepted writes not yet ended */

bool rejected[NREQ];
bool dispatched[NREQ];
byte faults = 0;         /* misbehaviour budget of the prefills */

/* a message to a process that may have stopped reading (a client that left, a reserve that
   timed out) is dropped when its queue is full; a lost reply is the caller's timeout and a
   lost stream event the client's abort, both modelled on their own */
#define TELL(r, ev, att)  if :: nfull(to_gw[r]) -> to_gw[r]!ev, att :: full(to_gw[r]) fi
#define REPLY(r, att, ep) if :: nfull(res_reply[r]) -> res_reply[r]!att, ep :: full(res_reply[r]) fi

chan to_dec = [2] of { mtype, byte, byte };          /* admission's publisher */
chan res_reply[NREQ] = [1] of { byte, byte };        /* attempt, epoch (0: saturated) */
chan from_pf[NLINKS] = [1] of { mtype, byte, byte };
chan from_gw = [2] of { byte, byte };                /* Abort: r, attempt */
chan committed = [2] of { byte, byte };
chan rfailed = [2] of { byte, byte };
chan to_gw[NREQ] = [2] of { mtype, byte };
/* a frame: kind, r, epoch, index, key, whose KV its bytes are */
chan data[NLINKS] = [2] of { mtype, byte, byte, byte, bool, byte };
chan atk = [1] of { mtype, byte, byte, byte, bool, byte };
/* r, slot epoch, page, index, bytes (an epoch or FOREIGN), whose KV */
chan writes = [2] of { byte, byte, byte, byte, byte, byte };

/* ---------------------------------------------------------------- the protocol trace */
/* A simulation (spin -T) prints, on lines starting "T ", the protocol trace the code writes
   (services/runtime/ptrace.py), with ' for ": verify.py feeds random runs and each variant's
   counterexample to tests/model/tracecheck.py. A lease is named by its epoch (L<epoch>), a
   request attempt R<r>a<attempt>; a page holds 16 tokens. */
#define T_PAGES(r) if :: need[r] == 1 -> printf(",'pages':[%d]", pg[r * 2]) \
                      :: else -> printf(",'pages':[%d,%d]", pg[r * 2], pg[r * 2 + 1]) fi
/* prefill's side: the job on link j is process prefill:1<j>, its lease Q<epoch> holds pages
   0..n-1 of its own pool Q (the model keeps prefill's pages out of the state; they print) */
#define T_PF_PAGES(n) if :: n == 1 -> printf(",'pages':[0]") :: else -> printf(",'pages':[0,1]") fi
#define T_PF_WRITTEN(j, ep, i) \
  printf("T {'p':'prefill:1%d','ev':'written','pool':'Q','lease':'Q%d','epoch':%d,'page':%d,'tokens':16}\n", \
         j, ep, ep, i)

/* ---------------------------------------------------------------- the invariants */
/* I1: a rejected request never holds a reservation or reaches a worker */
#define I1(r)  (!rejected[r] || (epoch[r] == 0 && !dispatched[r]))
/* no page in two live leases */
#define DISTINCT(a, b) (epoch[a] == 0 || epoch[b] == 0 || \
    ((pg[a*2] != pg[b*2]) && (need[a] < 2 || pg[a*2+1] != pg[b*2])) && \
    (need[b] < 2 || (pg[a*2] != pg[b*2+1] && (need[a] < 2 || pg[a*2+1] != pg[b*2+1]))))

active proctype Invariants() {
end:
  do
  :: atomic {
       !(I1(0) && I1(1) && I1(2) && DISTINCT(0, 1) && DISTINCT(0, 2) && DISTINCT(1, 2)) ->
       assert(I1(0) && I1(1) && I1(2));
       assert(DISTINCT(0, 1) && DISTINCT(0, 2) && DISTINCT(1, 2))
     }
  /* I6 where the system comes to rest: no lease is left. Every run of this model is finite
     (each loop consumes a message or ends a lease, and decode's liveness check can end any
     uncommitted one), so this is the liveness property below checked as safety. */
  :: timeout ->
     printf("T {'p':'decode:1','ev':'stop'}\n");
     printf("T {'p':'admission:2','ev':'stop'}\n");
     assert(leased == 0);
     break
  od
}

/* I6 (liveness, under weak fairness): every lease is eventually freed or quarantined */
ltl i6 { <> [] (leased == 0) }

/* ---------------------------------------------------------------- prefill's job */
/* KV tiers: the lookup for page i found entry e. Its bytes go into the page, which is marked
   written (readable by the remaining chunks, and sent) only once the entry's check passed:
   its tenant is the request's and it covers the request's tokens. A refused entry is
   computed instead. A miss (or a store down, slow or full) is prefill's computed branch. */
#define TIER_OK(r, e) ((e) / 4 == (r) && (e) % 4 == (r))
#ifndef NO_TIER_CHECK
#define COPY_REFUSED false
#else
#define COPY_REFUSED true          /* the check's verdict ignored */
#endif

inline tier_load(e) {
  atomic {
    nfull(data[j]) ->
    if
    :: TIER_OK(r, e) || COPY_REFUSED ->
       printf("T {'p':'prefill:1%d','ev':'tier_load','req':'R%da%d','lease':'Q%d','block':%d,'verified':%d,'pages':[%d]}\n",
              j, r, att, ep, i, TIER_OK(r, e), i);
       data[j]!DATA, r, ep, i, true, e
    :: else ->
       printf("T {'p':'prefill:1%d','ev':'tier_load','req':'R%da%d','lease':'Q%d','block':%d,'verified':0,'pages':[]}\n",
              j, r, att, ep, i);
       data[j]!DATA, r, ep, i, true, MINE(r)
    fi;
    T_PF_WRITTEN(j, ep, i);
    i++
  }
}

proctype Prefill(byte r, att, ep, n) {
  byte i = 0;
  byte j = LINK(r, att);
  if
  :: skip
  :: !PLAIN(r) -> atomic {                        /* refuses: tells decode, then the client */
       if :: from_pf[j]!RELEASE, r, att :: skip fi;
       TELL(r, FAILED, att)
     };
     goto quit
  fi;
  do
  :: i < n ->
     if
     :: !PLAIN(r) -> goto quit                     /* dies, is cut off, or sees an abort */
     :: atomic { data[j]!DATA, r, ep, i, true, MINE(r); T_PF_WRITTEN(j, ep, i); i++ }  /* computes */
     :: tier_load(KV(r, r))                        /* the tiers' entry: the request's own */
     :: tier_load(KV(OTHER, r))                    /* another tenant's, for the same tokens */
     :: tier_load(KV(r, OTHER))                    /* its tenant's, for other tokens */
     :: atomic { !PLAIN(r) && faults == 0 -> faults++; i++ }    /* misbehaves: skips a page it holds the key for */
     fi
  :: i == n -> break
  od;
  data[j]!COMMIT, r, ep, n, true, 0;
  if :: from_pf[j]!DONE, r, att :: skip fi;
quit:
  atomic {
    printf("T {'p':'prefill:1%d','ev':'free','pool':'Q','lease':'Q%d','epoch':%d", j, ep, ep);
    T_PF_PAGES(n);
    printf("}\n");
    i = 0; j = 0; r = 0; att = 0; ep = 0; n = 0    /* a finished job's locals: one state */
  }
}

/* ------------------------------------------- the gateway's request and admission's part */
proctype Client(byte r) {
  byte att = 0, ep, ra, n;
  mtype ev;
again:
  atomic {
    n = need[r];
#ifdef NO_REJECT_FIRST
    to_dec!RESERVE, r, att;                        /* the reservation goes out before the decision */
#endif
    if
    :: need[r] > CTX ->                            /* decide() */
       rejected[r] = true;
       printf("T {'p':'admission:2','ev':'decide','req':'R%da%d','verdict':'reject'}\n", r, att);
#ifdef INCIDENT
       n = 1;                                      /* "rejected", yet passed on as a stub */
       goto reserve;
#endif
       goto done
    :: else ->
       printf("T {'p':'admission:2','ev':'decide','req':'R%da%d','verdict':'admit'}\n", r, att)
    fi
  };
reserve:
#ifndef NO_REJECT_FIRST
  to_dec!RESERVE, r, att;
#endif
  do
  :: res_reply[r]?ra, ep ->
     if
     :: ra == att -> break
     :: else -> skip                               /* a late reply to a reserve that timed out */
     fi
  :: !PLAIN(r) -> ep = 0;                          /* the reserve call timed out */
     printf("T {'p':'admission:2','ev':'cancel','req':'R%da%d','lease':''}\n", r, att);
     if :: to_dec!CANCEL, r, att :: skip fi;
     break
  od;
  if
  :: ep == 0 -> goto done                          /* saturated: the client gets a 503 */
  :: else
  fi;
  /* the dispatch (a lost one is a prefill that dies before its first frame) */
  atomic {
    printf("T {'p':'admission:2','ev':'reserve','req':'R%da%d','lease':'L%d'}\n", r, att, ep);
    printf("T {'p':'admission:2','ev':'dispatch','req':'R%da%d','lease':'L%d'}\n", r, att, ep);
    printf("T {'p':'prefill:1%d','ev':'lease','pool':'Q','lease':'Q%d','req':'R%da%d','epoch':%d",
           LINK(r, att), ep, r, att, ep);
    T_PF_PAGES(n);
    printf(",'shared':[],'tokens':%d,'page_tokens':16}\n", 16 * n);
    dispatched[r] = true; run Prefill(r, att, ep, n)
  };
  do
  :: to_gw[r]?ev, ra ->
     if
     :: ra != att -> skip                          /* an earlier attempt's event */
     :: ra == att && ev == LOST && r == 0 && att == 0 && RESUME ->
        if :: from_gw!r, att :: skip fi;           /* the lost attempt is aborted (may be lost) */
        att++;
        goto again                                 /* resume: a new attempt */
     :: else -> goto done
     fi
  :: !PLAIN(r) ->                                 /* client gone or deadline */
     if :: from_gw!r, att :: skip fi;              /* (the Abort may be lost) */
     goto done
  od;
done:
  atomic { att = 0; ep = 0; ra = 0; n = 0; ev = 0 }
}

/* a sender without the key: one frame for r0's reservation id, either of its epochs (r0
   stands for any request: the attacker gains nothing from choosing r1) */
active proctype Attacker() {
  if
  :: atk!DATA, 0, 1, 0, false, KV(OTHER, OTHER)
  :: atk!DATA, 0, 2, 0, false, KV(OTHER, OTHER)
  fi
}

/* ---------------------------------------------------------------- decode's receiver */
#ifndef NO_COVERAGE
#define COVERED(r, n) (landed[r] == (1 << need[r]) - 1 && n == need[r])
#else
#define COVERED(r, n) true
#endif

inline frame(kind, r, ep, idx, key, src) {
  if
  :: kind == DATA ->
     if
#ifndef NO_FRAME_MAC
     :: !key -> skip                                /* MAC does not verify: dropped */
#endif
     :: else ->
        if
        :: !live[r] -> skip                         /* no live expectation: NACK */
#ifndef NO_EPOCH_CHECK
        :: live[r] && ep != epoch[r] ->             /* stale epoch: fails its own request */
           live[r] = false;
           printf("T {'p':'decode:1','ev':'fail','lease':'L%d','epoch':%d}\n", epoch[r], epoch[r]);
           rfailed!r, epoch[r]
#endif
        :: else ->                                  /* the write into the page begins */
           printf("T {'p':'decode:1','ev':'accept','lease':'L%d','epoch':%d,'index':%d}\n",
                  epoch[r], ep, idx);
           inflight[r]++;
           if
           :: key -> writes!r, epoch[r], pg[r * 2 + idx], idx, ep, src
           :: else -> writes!r, epoch[r], pg[r * 2 + idx], idx, FOREIGN, src
           fi
        fi
     fi
  :: kind == COMMIT ->
     if
     :: live[r] && ep == epoch[r] && COVERED(r, idx) -> live[r] = false;
        printf("T {'p':'decode:1','ev':'commit','lease':'L%d','epoch':%d,'ok':1}\n", ep, ep);
        committed!r, ep
     :: else ->
        if
        :: live[r] && ep == epoch[r] -> live[r] = false;
           printf("T {'p':'decode:1','ev':'commit','lease':'L%d','epoch':%d,'ok':0}\n", ep, ep);
           rfailed!r, ep
        :: else -> skip
        fi
     fi
  fi;
  kind = 0; r = 0; ep = 0; idx = 0; key = false; src = 0
}

active proctype Receiver() {
  mtype kind;
  byte r, ep, idx, p, src;
  bool key;
end:
  do
  :: atomic { data[0]?kind, r, ep, idx, key, src -> frame(kind, r, ep, idx, key, src) }
  :: atomic { data[1]?kind, r, ep, idx, key, src -> frame(kind, r, ep, idx, key, src) }
  :: atomic { data[2]?kind, r, ep, idx, key, src -> frame(kind, r, ep, idx, key, src) }
  :: atomic { data[3]?kind, r, ep, idx, key, src -> frame(kind, r, ep, idx, key, src) }
  :: atomic { atk?kind, r, ep, idx, key, src -> frame(kind, r, ep, idx, key, src) }
  :: atomic { writes?r, ep, p, idx, kind, src ->    /* a write in flight ends: its bytes land */
     /* I3: no byte lands in a lease after its fence returned, nor in another lease
        (a quarantined page may still take it: it is never leased again) */
     assert(owner[p] == QUAR || owner[p] == ep);
     content[p] = kind;
     own_kv[p] = (src == MINE(r));
     printf("T {'p':'decode:1','ev':'land','lease':'L%d','epoch':%d,'index':%d}\n", ep, ep, idx);
     if :: epoch[r] == ep -> landed[r] = landed[r] | (1 << idx) :: else fi;
     inflight[r]--;
     kind = 0; r = 0; ep = 0; idx = 0; p = 0; src = 0 }
  od
}

/* ---------------------------------------------------------------- decode */
inline allocate(r, ok) {
  ok = false;
  if
  :: leased + need[r] <= NPAGES ->
     k = 0; p = 0;
     do
     :: k == need[r] -> break
     :: k < need[r] && p < NPAGES && owner[p] == FREE ->
        pg[r * 2 + k] = p; k++; p++
     :: k < need[r] && p < NPAGES && owner[p] != FREE -> p++
     :: k < need[r] && p == NPAGES -> break         /* quarantined pages are not free */
     od;
     if
     :: k == need[r] ->
        ok = true;
        k = 0;
        do
        :: k < need[r] -> owner[pg[r * 2 + k]] = next_epoch; k++
        :: else -> break
        od;
        leased = leased + need[r];
        epoch[r] = next_epoch;
        next_epoch++;
        printf("T {'p':'decode:1','ev':'lease','pool':'P','lease':'L%d','req':'R%da%d','epoch':%d",
               epoch[r], r, att, epoch[r]);
        T_PAGES(r);
        printf(",'shared':[],'tokens':%d,'page_tokens':16}\n", 16 * need[r])
     :: else
     fi;
     k = 0; p = 0
  :: else
  fi
}

inline free_pages(r, e, to) {
  k = 0;
  do
  :: k < need[r] ->
#ifndef RELEASE_TWICE
     assert(owner[pg[r * 2 + k]] == e);
#endif
     owner[pg[r * 2 + k]] = to;
     k++
  :: else -> break
  od;
  k = 0;
  leased = leased - need[r];
  if
  :: to == QUAR -> printf("T {'p':'decode:1','ev':'quarantine','pool':'P','lease':'L%d','epoch':%d", e, e)
  :: else -> printf("T {'p':'decode:1','ev':'free','pool':'P','lease':'L%d','epoch':%d", e, e)
  fi;
  T_PAGES(r);
  printf("}\n")
}

/* fence, then free or quarantine, then tell: every terminal path of decode */
inline conclude(r, ev) {
  e = epoch[r];
  quar = false;
  live[r] = false;                                  /* fence: no new write starts */
  if
  :: inflight[r] == 0
  :: inflight[r] > 0 ->
     if
#ifndef NO_FENCE_WAIT
     :: inflight[r] == 0                            /* waits for the write in flight */
#else
     :: true
#endif
     :: quar = true                                 /* its end cannot be established */
     fi
  fi;
  printf("T {'p':'decode:1','ev':'fence','lease':'L%d','ok':%d}\n", e, !quar);
#ifdef TELL_FIRST
  if
  :: ev != 0 ->
     printf("T {'p':'decode:1','ev':'tell','req':'R%da%d','lease':'L%d'}\n", r, att_of[r], e);
     if :: to_gw[r]!ev, att_of[r] :: goto leak fi   /* a failed publish raises */
  :: else
  fi;
#endif
#ifndef NO_QUARANTINE
  if :: quar -> free_pages(r, e, QUAR) :: else -> free_pages(r, e, FREE) fi;
#else
  free_pages(r, e, FREE);
#endif
#ifndef TELL_FIRST
  if
  :: ev != 0 ->
     printf("T {'p':'decode:1','ev':'tell','req':'R%da%d','lease':'L%d'}\n", r, att_of[r], e);
     TELL(r, ev, att_of[r])
  :: else
  fi;
#endif
leak:
  epoch[r] = 0;
  state[r] = S_NONE;
  landed[r] = 0;
#ifndef RELEASE_TWICE
  att_of[r] = 0;                                    /* unread until the next reserve */
  pg[r * 2] = 255; pg[r * 2 + 1] = 255;
#endif
  e = 0; quar = false
}

inline read_pages(r) {                              /* the first decode step's attention */
  printf("T {'p':'decode:1','ev':'written','pool':'P','lease':'L%d','epoch':%d,'page':%d,'tokens':16}\n",
         epoch[r], epoch[r], pg[r * 2]);
  if
  :: need[r] == 2 ->
     printf("T {'p':'decode:1','ev':'written','pool':'P','lease':'L%d','epoch':%d,'page':%d,'tokens':16}\n",
            epoch[r], epoch[r], pg[r * 2 + 1])
  :: else
  fi;
  printf("T {'p':'decode:1','ev':'read','pool':'P','lease':'L%d','epoch':%d,'tokens':%d}\n",
         epoch[r], epoch[r], 16 * need[r]);
  k = 0;
  do
  :: k < need[r] ->
     /* I2: decode reads only pages written in its own lease's epoch */
     assert(owner[pg[r * 2 + k]] == epoch[r] && content[pg[r * 2 + k]] == epoch[r]);
     /* I9: and those bytes are the KV of this request's own tenant and tokens (none came
        from a tier entry of another tenant or another prompt) */
     assert(own_kv[pg[r * 2 + k]]);
     k++
  :: else -> break
  od;
  k = 0
}

inline pf_msg(j) {
  atomic { from_pf[j]?kind, r, att ->
    if
    :: kind == RELEASE && epoch[r] != 0 && att_of[r] == att -> conclude(r, FAILED)
#ifdef WRITTEN_EARLY
    :: kind == DONE && epoch[r] != 0 && att_of[r] == att && state[r] == S_RESERVED ->
       state[r] = S_WRITTEN; read_pages(r); conclude(r, FINISHED)
#endif
    :: else
    fi;
    kind = 0; r = 0; att = 0 }
}

inline stall(x) {
  atomic { epoch[x] != 0 && state[x] == S_RESERVED -> conclude(x, LOST) }
}

active proctype Decode() {
  mtype kind;
  byte r, att, ep, e, k, p;
  bool ok, quar;
end:
  do
  :: atomic { to_dec?kind, r, att ->
     if
     :: kind == RESERVE ->
        if :: epoch[r] != 0 -> conclude(r, 0) :: else fi   /* an earlier reservation of r */
        allocate(r, ok);
        assert(!rejected[r]);                        /* I1, where a worker hears of it */
        if
        :: ok ->
           att_of[r] = att; state[r] = S_RESERVED;
           live[r] = true; landed[r] = 0;
           printf("T {'p':'decode:1','ev':'expect','lease':'L%d','epoch':%d,'pages':%d}\n",
                  epoch[r], epoch[r], need[r]);
           REPLY(r, att, epoch[r])
        :: else -> REPLY(r, att, 0)                  /* saturated */
        fi
     :: kind == CANCEL ->                            /* quiet: no word on the stream */
        if :: epoch[r] != 0 && att_of[r] == att && state[r] == S_RESERVED -> conclude(r, 0)
           :: else fi
     fi;
     kind = 0; r = 0; att = 0; ok = false }
  :: pf_msg(0)
  :: pf_msg(1)
  :: pf_msg(2)
  :: pf_msg(3)
  :: atomic { from_gw?r, att ->                      /* Abort */
#ifdef RELEASE_TWICE
     if :: att_of[r] == att && state[r] == S_NONE && pg[r * 2] != 255 ->
             free_pages(r, 0, FREE); leased = leased + need[r]
        :: else fi;
#endif
     if :: epoch[r] != 0 && att_of[r] == att -> conclude(r, 0) :: else fi;
     r = 0; att = 0 }
  :: atomic { committed?r, ep ->                     /* the verified commit */
     if
     :: epoch[r] == ep && state[r] == S_RESERVED ->
        state[r] = S_WRITTEN;                        /* marked written only now */
        read_pages(r);
        conclude(r, FINISHED)
     :: else
     fi;
     r = 0; ep = 0 }
  :: atomic { rfailed?r, ep ->
     if :: epoch[r] == ep && state[r] == S_RESERVED -> conclude(r, FAILED) :: else fi;
     r = 0; ep = 0 }
  /* prefill silent for a reservation not yet committed: heartbeat loss or progress stall */
  :: stall(0)
  :: stall(1)
  :: stall(2)
  od
}

init {
  byte i = 0;
  atomic {
    need[0] = 1; need[1] = 1; need[2] = 2;
    do :: i < NREQ * 2 -> pg[i] = 255; i++ :: else -> break od;
    i = 0;
    run Client(0);
#ifndef CONF_RESUME
    run Client(1);
#endif
    run Client(2)
  }
}
