/* fate-rdma WAN testbed: the delay and reordering stage of a shaped link (netem is not in this kernel).
 *
 * The router namespace routes every packet that arrives from a site into a TUN device (policy rule
 * "iif <site link> lookup <table>", table: "default dev <tun>"). This helper reads each packet from the
 * TUN, holds it for the one-way delay of the link it came from (chosen by its IPv4 source address), and
 * writes it back into the TUN; the kernel sees it arrive on the TUN (iif = tun, so the policy rule does
 * not match again) and forwards it by the main table to the destination site's link, whose tbf shapes it.
 *
 * Reordering: a packet is, with probability reorder_ppm / 1e6, held reorder_gap_us longer than the
 * link's delay, so packets behind it overtake it (netem's "reorder" with a gap in time instead of count).
 * Each (rule, late?) pair is one FIFO because its hold time is constant, so no heap is needed.
 *
 * Usage: wan-delay --tun NAME [--limit PKTS] [--stats FILE]
 *                  --rule A.B.C.D/LEN,DELAY_US,REORDER_PPM,GAP_US [--rule ...]
 * Packets matching no rule are written back at once. --limit bounds the packets held (tail drop beyond,
 * counted as "overflow"), like netem's limit. --stats is rewritten about once a second with counters.
 * Exits on SIGTERM/SIGINT. Plain C99 + Linux headers: compiled by `fate-rdma wan up` with the system cc.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#define SLOT_BYTES 2048 /* > the testbed's MTU (1500); a longer packet would be truncated, so the MTU is checked */
#define MAX_RULES 16
#define READ_BATCH 256  /* packets read per wake-up before writing due ones again */

struct rule { uint32_t net, mask; uint64_t delay_us, gap_us; uint32_t reorder_ppm; };
struct fifo { uint32_t *idx; uint64_t *due_us; uint32_t head, len; };

static struct rule rules[MAX_RULES];
static int nrules;
static struct fifo fifos[2 * MAX_RULES];
static unsigned char *pool;    /* limit slots of SLOT_BYTES */
static uint16_t *pool_len;
static uint32_t *free_stack, free_top, limit = 20000;
static volatile sig_atomic_t stop;
static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t n_in, n_out, n_overflow, n_reordered, n_passthrough, n_write_err, bytes_in;

static void on_signal(int sig) { (void)sig; stop = 1; }

static uint64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static uint64_t xorshift(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return rng;
}

static void die(const char *what) { fprintf(stderr, "wan-delay: %s: %s\n", what, strerror(errno)); exit(1); }

static void usage(const char *msg) {
    fprintf(stderr, "wan-delay: %s\nusage: wan-delay --tun NAME [--limit PKTS] [--stats FILE] "
                    "--rule A.B.C.D/LEN,DELAY_US,REORDER_PPM,GAP_US ...\n", msg);
    exit(2);
}

static void parse_rule(const char *s) {
    char net[32];
    unsigned len;
    unsigned long long d, gap;
    unsigned ppm;
    struct in_addr a;
    if (nrules == MAX_RULES) usage("too many --rule");
    if (sscanf(s, "%31[0-9.]/%u,%llu,%u,%llu", net, &len, &d, &ppm, &gap) != 5 || len > 32 || ppm > 1000000 ||
        inet_pton(AF_INET, net, &a) != 1)
        usage("bad --rule (want A.B.C.D/LEN,DELAY_US,REORDER_PPM,GAP_US)");
    rules[nrules].mask = len ? htonl(0xFFFFFFFFu << (32 - len)) : 0;
    rules[nrules].net = a.s_addr & rules[nrules].mask;
    rules[nrules].delay_us = d;
    rules[nrules].reorder_ppm = ppm;
    rules[nrules].gap_us = gap;
    nrules++;
}

static int open_tun(const char *name) {
    struct ifreq ifr;
    int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) die("open /dev/net/tun");
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
    if (strlen(name) >= IFNAMSIZ) usage("--tun name too long");
    strcpy(ifr.ifr_name, name);
    if (ioctl(fd, TUNSETIFF, &ifr) < 0) die("TUNSETIFF (attach to the tun device)");
    return fd;
}

static void write_stats(const char *path, uint64_t held) {
    char tmp[4096];
    FILE *f;
    if (!path) return;
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if (!(f = fopen(tmp, "w"))) return;
    fprintf(f, "{\"in\": %llu, \"out\": %llu, \"bytes_in\": %llu, \"held\": %llu, \"overflow\": %llu, "
               "\"reordered\": %llu, \"passthrough\": %llu, \"write_errors\": %llu, \"limit\": %u}\n",
            (unsigned long long)n_in, (unsigned long long)n_out, (unsigned long long)bytes_in,
            (unsigned long long)held, (unsigned long long)n_overflow, (unsigned long long)n_reordered,
            (unsigned long long)n_passthrough, (unsigned long long)n_write_err, limit);
    fclose(f);
    rename(tmp, path);
}

static void emit(int fd, const unsigned char *p, size_t n) {
    /* a tun write hands the packet to the stack at once; it does not block or return EAGAIN */
    if (write(fd, p, n) < 0) n_write_err++;
    else n_out++;
}

int main(int argc, char **argv) {
    const char *tun = NULL, *stats = NULL;
    int fd, i;
    uint64_t held = 0, last_stats = 0;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tun") && i + 1 < argc) tun = argv[++i];
        else if (!strcmp(argv[i], "--stats") && i + 1 < argc) stats = argv[++i];
        else if (!strcmp(argv[i], "--limit") && i + 1 < argc) limit = (uint32_t)strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--rule") && i + 1 < argc) parse_rule(argv[++i]);
        else usage("unknown argument");
    }
    if (!tun) usage("--tun is required");
    if (limit < 16 || limit > 1000000) usage("--limit must be 16..1000000");
    /* calloc'd memory is only touched as packets are held: a large limit costs nothing until used */
    pool = calloc(limit, SLOT_BYTES);
    pool_len = calloc(limit, sizeof *pool_len);
    free_stack = calloc(limit, sizeof *free_stack);
    if (!pool || !pool_len || !free_stack) die("calloc");
    for (i = 0; i < 2 * nrules; i++) {
        fifos[i].idx = calloc(limit, sizeof(uint32_t));
        fifos[i].due_us = calloc(limit, sizeof(uint64_t));
        if (!fifos[i].idx || !fifos[i].due_us) die("calloc");
    }
    for (free_top = 0; free_top < limit; free_top++) free_stack[free_top] = limit - 1 - free_top;
    rng ^= (uint64_t)getpid() << 32 ^ now_us();
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    signal(SIGPIPE, SIG_IGN);
    fd = open_tun(tun);

    while (!stop) {
        uint64_t now = now_us(), next = UINT64_MAX;
        struct pollfd pfd = {fd, POLLIN, 0};
        struct timespec ts, *tsp = NULL;
        int q, got;
        for (q = 0; q < 2 * nrules; q++) { /* write everything that is due, in each FIFO's order */
            struct fifo *f = &fifos[q];
            while (f->len && f->due_us[f->head] <= now) {
                uint32_t s = f->idx[f->head];
                emit(fd, pool + (size_t)s * SLOT_BYTES, pool_len[s]);
                free_stack[free_top++] = s;
                held--;
                f->head = (f->head + 1) % limit;
                f->len--;
            }
            if (f->len && f->due_us[f->head] < next) next = f->due_us[f->head];
        }
        if (now - last_stats >= 1000000) { write_stats(stats, held); last_stats = now; }
        if (next != UINT64_MAX) {
            uint64_t wait = next > now ? next - now : 0;
            ts.tv_sec = (time_t)(wait / 1000000u);
            ts.tv_nsec = (long)(wait % 1000000u) * 1000;
            tsp = &ts;
        } else {
            ts.tv_sec = 1; ts.tv_nsec = 0; tsp = &ts; /* wake up for the stats file */
        }
        if (ppoll(&pfd, 1, tsp, NULL) < 0) {
            if (errno == EINTR) continue;
            die("ppoll");
        }
        if (!(pfd.revents & POLLIN)) continue;
        now = now_us();
        for (got = 0; got < READ_BATCH; got++) {
            unsigned char *p;
            uint32_t s, src;
            ssize_t n;
            int r, late;
            if (!free_top) { /* full: read into a scratch slot and drop (tail drop) */
                static unsigned char scratch[SLOT_BYTES];
                n = read(fd, scratch, sizeof scratch);
                if (n < 0) break;
                n_in++; n_overflow++; bytes_in += (uint64_t)n;
                continue;
            }
            s = free_stack[free_top - 1];
            p = pool + (size_t)s * SLOT_BYTES;
            n = read(fd, p, SLOT_BYTES);
            if (n < 0) {
                if (errno == EAGAIN || errno == EINTR) break;
                die("read from tun");
            }
            n_in++; bytes_in += (uint64_t)n;
            if (n < 20 || (p[0] >> 4) != 4) { emit(fd, p, (size_t)n); n_passthrough++; continue; }
            memcpy(&src, p + 12, 4);
            for (r = 0; r < nrules; r++)
                if ((src & rules[r].mask) == rules[r].net) break;
            if (r == nrules || (rules[r].delay_us == 0 && rules[r].reorder_ppm == 0)) {
                emit(fd, p, (size_t)n); n_passthrough++; continue;
            }
            late = rules[r].reorder_ppm && (xorshift() % 1000000u) < rules[r].reorder_ppm;
            {
                struct fifo *f = &fifos[2 * r + late];
                uint32_t tail = (f->head + f->len) % limit;
                free_top--;
                pool_len[s] = (uint16_t)n;
                f->idx[tail] = s;
                f->due_us[tail] = now + rules[r].delay_us + (late ? rules[r].gap_us : 0);
                f->len++;
                held++;
                if (late) n_reordered++;
            }
        }
    }
    write_stats(stats, held);
    return 0;
}
