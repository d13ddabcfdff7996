/*
 * pdmesh's request path and KV handoff as a Promela model (Spin), at the level of
 * docs/DESIGN.md. Not yet wired into make or CI, and its state space is not yet small
 * enough to explore in full (see below); to check it by hand:
 *
 *   spin -a handoff.pml && gcc -O2 -DSAFETY -DNOCLAIM -DBITSTATE -DVECTORSZ=2048 -o pan pan.c
 *   ./pan -m2000000 -w30                          # safety: assertions and end states
 *   spin -DNO_FENCE_WAIT -a handoff.pml ...       # a variant: expect a counterexample
 *
 * A full search (-DCOLLAPSE instead of -DBITSTATE) does not fit in 20 GiB yet.
 *
 * Three requests: r0 and r1 fit the served context, r2 does not (the incident's prompt).
 * Decode's pool has two pages, so pages are leased again to other requests and to a
 * request's resumed attempt. Page bytes are never zeroed on free (content[] keeps the epoch
 * of the last write), so a read of a page this lease did not write sees another epoch.
 * Control messages (Abort, Release, ReserveCancel, the dispatch, stream events) may be lost;
 * each sender's frames arrive in order on their own link, links interleave freely; a
 * prefill may die or be cut off at any chunk, or misbehave once (skip a page while holding
 * the key); a sender without the key injects one frame; decode's liveness check (heartbeat
 * loss, progress stall) may fire on any reservation not yet committed; a fence may time out
 * with a write in flight.
 *
 * Abstractions (each gives the protocol less than the code has, so what holds here holds
 * there): the reservation id is the request's index, reused by its resumed attempt (the
 * code's is a fresh UUID); the frame MAC is "only a key holder of this reservation id" (the
 * code's key is fresh per reservation and bound to the epoch); the receiver does not check
 * page order or duplicates (the code does); a page holds a whole request's worth of tokens.
 *
 * Variants (one guard removed each, selected with spin -D<NAME>; each should give a
 * counterexample):
 *   NO_REJECT_FIRST   admission reserves before it decides
 *   INCIDENT          a rejected prompt goes on as a 1-page stub into a full reservation
 *   NO_EPOCH_CHECK    the receiver takes a frame whatever its epoch
 *   NO_FRAME_MAC      the receiver takes a frame from a sender without the key
 *   NO_COVERAGE       the receiver accepts a commit whatever pages landed
 *   WRITTEN_EARLY     decode reads when prefill says it is done, not on the verified commit
 *   NO_FENCE_WAIT     fence returns with a write still in flight
 *   NO_QUARANTINE     a fence that timed out frees the pages instead of setting them aside
 *   TELL_FIRST        decode tells the client before it frees (a failed publish leaks)
 *   RELEASE_TWICE     a late Abort frees a lease's pages again (release not idempotent)
 */

#define NREQ    3
#define NPAGES  2
#define CTX     1        /* served context, in pages */
#define MAXATT  2        /* a request's first attempt and one resume */
#define NLINKS  6        /* one data link per (request, attempt) */

#define FREE    0
#define QUAR    254      /* quarantined: never leased again */
#define FOREIGN 253      /* bytes from a sender without the key */

mtype = { ADMITTED, REJECTED, SATURATED,            /* admission -> gateway */
          RESERVE, CANCEL,                          /* admission -> decode */
          RELEASE, DONE,                            /* prefill -> decode */
          ABORT,                                    /* gateway -> workers */
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
bool fenced[NREQ];       /* a fence returned for the current epoch */

bool rejected[NREQ];
bool dispatched[NREQ];
bool aborted[NLINKS];    /* the Abort broadcast, as prefill's job sees it */
byte faults = 0;         /* misbehaviour budget of the prefills */

chan submit = [NREQ] of { byte, byte };
chan sreply[NREQ] = [1] of { mtype };
chan to_dec = [4] of { mtype, byte, byte };
chan res_reply = [6] of { byte, byte, byte };
chan from_pf = [6] of { mtype, byte, byte };
chan from_gw = [6] of { mtype, byte, byte };
chan committed = [4] of { byte, byte };
chan rfailed = [4] of { byte, byte };
chan to_gw[NREQ] = [4] of { mtype, byte };
chan data[NLINKS] = [3] of { mtype, byte, byte, byte, bool };
chan atk = [1] of { mtype, byte, byte, byte, bool };
chan writes = [4] of { byte, byte, byte, byte, bool };  /* r, slot epoch, page, index, key */

/* ---------------------------------------------------------------- the invariants */
/* I1: a rejected request never holds a reservation or reaches a worker */
#define I1(r)  (!rejected[r] || (epoch[r] == 0 && !dispatched[r]))
/* no page in two live leases */
#define DISTINCT(a, b) (epoch[a] == 0 || epoch[b] == 0 || \
    ((pg[a*2] != pg[b*2]) && (need[a] < 2 || pg[a*2+1] != pg[b*2])) && \
    (need[b] < 2 || (pg[a*2] != pg[b*2+1] && (need[a] < 2 || pg[a*2+1] != pg[b*2+1]))))

active proctype Invariants() {
end: atomic {
    !(I1(0) && I1(1) && I1(2) && DISTINCT(0, 1) && DISTINCT(0, 2) && DISTINCT(1, 2)) ->
    assert(I1(0) && I1(1) && I1(2));
    assert(DISTINCT(0, 1) && DISTINCT(0, 2) && DISTINCT(1, 2))
  }
}

/* I6 (liveness, under weak fairness): every lease is eventually freed or quarantined */
ltl i6 { <> [] (leased == 0) }

/* ---------------------------------------------------------------- the gateway */
proctype Gateway(byte r) {
  byte att = 0, a;
  mtype ans, ev;
again:
  submit!r, att;
  sreply[r]?ans;
  if
  :: ans != ADMITTED -> goto done
  :: else
  fi;
  do
  :: to_gw[r]?ev, a ->
     if
     :: a != att -> skip                           /* an earlier attempt's event */
     :: a == att && ev == LOST && att + 1 < MAXATT ->
        if :: from_gw!ABORT, r, att :: skip fi;  /* the lost attempt is aborted (may be lost) */
        aborted[r * MAXATT + att] = true;
        att++;
        goto again                                  /* resume: a new attempt */
     :: else -> goto done
     fi
  :: if :: from_gw!ABORT, r, att :: skip fi;  /* client gone or deadline (may be lost) */
     aborted[r * MAXATT + att] = true;
     goto done
  od;
done:
  skip
}

/* ---------------------------------------------------------------- prefill's job */
proctype Prefill(byte r, att, ep, n) {
  byte i = 0;
  byte j = r * MAXATT + att;
  if
  :: skip
  :: if :: from_pf!RELEASE, r, att :: skip fi;  /* refuses: tells decode, then the client */
     if :: to_gw[r]!FAILED, att :: skip fi;
     goto quit
  fi;
  do
  :: i < n ->
     if
     :: aborted[j] -> goto quit                    /* an abort, seen at a chunk boundary */
     :: goto quit                                  /* dies or is cut off: silent from here */
     :: data[j]!DATA, r, ep, i, true; i++
     :: atomic { faults == 0 -> faults++; i++ }    /* misbehaves: skips a page it holds the key for */
     fi
  :: i == n -> break
  od;
  data[j]!COMMIT, r, ep, n, true;
  if :: from_pf!DONE, r, att :: skip fi;
quit:
  skip
}

/* ---------------------------------------------------------------- admission */
active proctype Admission() {
  byte r, att, ep, rr, ra, n;
end:
  do
  :: submit?r, att ->
     n = need[r];
#ifdef NO_REJECT_FIRST
     to_dec!RESERVE, r, att;          /* the reservation goes out before the decision */
#endif
     if
     :: need[r] > CTX ->              /* decide() */
        rejected[r] = true;
#ifdef INCIDENT
        n = 1;                        /* "rejected", yet passed on as a stub */
        goto reserve;
#endif
        sreply[r]!REJECTED
     :: else ->
reserve:
#ifndef NO_REJECT_FIRST
        to_dec!RESERVE, r, att;
#endif
        do
        :: res_reply?rr, ra, ep ->
           if
           :: rr == r && ra == att -> break
           :: else -> skip            /* a late reply to a reserve that timed out */
           fi
        :: ep = 0;                    /* the reserve call timed out */
           if :: to_dec!CANCEL, r, att :: skip fi;
           break
        od;
        if
        :: ep == 0 -> sreply[r]!SATURATED
        :: else ->
           dispatched[r] = true;
           if :: run Prefill(r, att, ep, n) :: skip fi;  /* the dispatch (may be lost) */
           sreply[r]!ADMITTED
        fi
     fi
  od
}

/* a sender without the key: one frame, any reservation, any epoch */
active proctype Attacker() {
  byte r, ep;
  select(r : 0 .. 1);
  select(ep : 1 .. 3);
  atk!DATA, r, ep, 0, false
}

/* ---------------------------------------------------------------- decode's receiver */
#ifndef NO_COVERAGE
#define COVERED(r, n) (landed[r] == (1 << need[r]) - 1 && n == need[r])
#else
#define COVERED(r, n) true
#endif

inline frame(kind, r, ep, idx, key) {
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
           rfailed!r, epoch[r]
#endif
        :: else ->                                  /* the write into the page begins */
           inflight[r]++;
           writes!r, epoch[r], pg[r * 2 + idx], idx, key
        fi
     fi
  :: kind == COMMIT ->
     if
     :: live[r] && ep == epoch[r] && COVERED(r, idx) -> live[r] = false;
           committed!r, ep
     :: else ->
        if
        :: live[r] && ep == epoch[r] -> live[r] = false; rfailed!r, ep
        :: else -> skip
        fi
     fi
  fi
}

active proctype Receiver() {
  mtype kind;
  byte r, ep, idx, p;
  bool key;
end:
  do
  :: atomic { data[0]?kind, r, ep, idx, key -> frame(kind, r, ep, idx, key) }
  :: atomic { data[1]?kind, r, ep, idx, key -> frame(kind, r, ep, idx, key) }
  :: atomic { data[2]?kind, r, ep, idx, key -> frame(kind, r, ep, idx, key) }
  :: atomic { data[3]?kind, r, ep, idx, key -> frame(kind, r, ep, idx, key) }
  :: atomic { data[4]?kind, r, ep, idx, key -> frame(kind, r, ep, idx, key) }
  :: atomic { data[5]?kind, r, ep, idx, key -> frame(kind, r, ep, idx, key) }
  :: atomic { atk?kind, r, ep, idx, key -> frame(kind, r, ep, idx, key) }
  :: atomic { writes?r, ep, p, idx, key ->          /* a write in flight ends: its bytes land */
     /* I3: no byte lands in a lease after its fence returned, nor in another lease
        (a quarantined page may still take it: it is never leased again) */
     assert(owner[p] == QUAR || (owner[p] == ep && !(fenced[r] && epoch[r] == ep)));
     if :: key -> content[p] = ep :: else -> content[p] = FOREIGN fi;
     if :: epoch[r] == ep -> landed[r] = landed[r] | (1 << idx) :: else fi;
     inflight[r]-- }
  od
}

/* ---------------------------------------------------------------- decode */
inline allocate(r, ok) {
  ok = false;
  if
  :: leased + need[r] <= NPAGES ->
     byte k = 0, p = 0;
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
        next_epoch++
     :: else
     fi
  :: else
  fi
}

inline free_pages(r, e, to) {
  byte q = 0;
  do
  :: q < need[r] ->
#ifdef RELEASE_TWICE
     owner[pg[r * 2 + q]] = to;
#else
     assert(owner[pg[r * 2 + q]] == e);
     owner[pg[r * 2 + q]] = to;
#endif
     q++
  :: else -> break
  od;
  leased = leased - need[r]
}

/* fence, then free or quarantine, then tell: every terminal path of decode */
inline conclude(r, ev) {
  byte e = epoch[r];
  bool quar = false;
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
  if :: !quar -> fenced[r] = true :: else fi;        /* fence returned (else it raised) */
#ifdef TELL_FIRST
  if
  :: ev != 0 -> if :: to_gw[r]!ev, att_of[r] :: goto leak fi   /* a failed publish raises */
  :: else
  fi;
#endif
#ifndef NO_QUARANTINE
  if :: quar -> free_pages(r, e, QUAR) :: else -> free_pages(r, e, FREE) fi;
#else
  free_pages(r, e, FREE);
#endif
#ifndef TELL_FIRST
  if :: ev != 0 -> if :: to_gw[r]!ev, att_of[r] :: skip fi :: else fi;
#endif
leak:
  epoch[r] = 0;
  state[r] = S_NONE
}

inline read_pages(r) {                              /* the first decode step's attention */
  byte q = 0;
  do
  :: q < need[r] ->
     /* I2: decode reads only pages written in its own lease's epoch */
     assert(owner[pg[r * 2 + q]] == epoch[r] && content[pg[r * 2 + q]] == epoch[r]);
     q++
  :: else -> break
  od
}

active proctype Decode() {
  mtype kind;
  byte r, att, ep;
  bool ok;
end:
  do
  :: atomic { to_dec?kind, r, att ->
     if
     :: kind == RESERVE ->
        assert(!rejected[r]);                        /* I1, where a worker hears of it */
        if :: epoch[r] != 0 -> conclude(r, 0) :: else fi   /* an earlier reservation of r */
        allocate(r, ok);
        if
        :: ok ->
           att_of[r] = att; state[r] = S_RESERVED;
           live[r] = true; landed[r] = 0; fenced[r] = false;
           res_reply!r, att, epoch[r]
        :: else -> res_reply!r, att, 0               /* saturated: admission places elsewhere */
        fi
     :: kind == CANCEL ->                            /* quiet: no word on the stream */
        if :: epoch[r] != 0 && att_of[r] == att && state[r] == S_RESERVED -> conclude(r, 0)
           :: else fi
     fi }
  :: atomic { from_pf?kind, r, att ->
     if
     :: kind == RELEASE && epoch[r] != 0 && att_of[r] == att -> conclude(r, FAILED)
#ifdef WRITTEN_EARLY
     :: kind == DONE && epoch[r] != 0 && att_of[r] == att && state[r] == S_RESERVED ->
        state[r] = S_WRITTEN; read_pages(r); conclude(r, FINISHED)
#endif
     :: else
     fi }
  :: atomic { from_gw?kind, r, att ->                         /* Abort */
#ifdef RELEASE_TWICE
     if :: att_of[r] == att && state[r] == S_NONE && pg[r * 2] != 255 ->
             free_pages(r, 0, FREE); leased = leased + need[r]
        :: else fi;
#endif
     if :: epoch[r] != 0 && att_of[r] == att -> conclude(r, 0) :: else fi }
  :: atomic { committed?r, ep ->                              /* the verified commit */
     if
     :: epoch[r] == ep && state[r] == S_RESERVED ->
        state[r] = S_WRITTEN;                        /* marked written only now */
        read_pages(r);
        conclude(r, FINISHED)
     :: else
     fi }
  :: atomic { rfailed?r, ep ->
     if :: epoch[r] == ep && state[r] == S_RESERVED -> conclude(r, FAILED) :: else fi }
  /* prefill silent for a reservation not yet committed: heartbeat loss or progress stall */
  :: atomic { epoch[0] != 0 && state[0] == S_RESERVED -> r = 0; conclude(r, LOST) }
  :: atomic { epoch[1] != 0 && state[1] == S_RESERVED -> r = 1; conclude(r, LOST) }
  :: atomic { epoch[2] != 0 && state[2] == S_RESERVED -> r = 2; conclude(r, LOST) }
  od
}

init {
  need[0] = 1; need[1] = 1; need[2] = 2;
  byte i = 0;
  do :: i < NREQ * 2 -> pg[i] = 255; i++ :: else -> break od;
  atomic { run Gateway(0); run Gateway(1); run Gateway(2) }
}
