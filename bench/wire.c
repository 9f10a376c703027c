/* The network between emulated hosts: a learning Ethernet switch over TAP devices that holds every
 * frame for a fixed time before passing it on.
 *
 * Why not a kernel bridge with `tc netem`: this machine's kernel has no netem (CONFIG_NET_SCH_NETEM is
 * not set), so a link's added delay is made here. The TAP devices use a 64 KB MTU, so a bulk TCP
 * transfer is a few thousand frames a second and the copy through this process stays cheap.
 *
 *   wire [-l LOSS_PPM] DELAY_US TAP...   open (create) each TAP device, print "ready", switch until SIGTERM
 *
 * Each frame is lost with probability LOSS_PPM / 1e6, else waits DELAY_US microseconds (so a round trip
 * gains 2 x DELAY_US), then goes to the port its destination MAC was last seen on, or to every other port. One FIFO serves all ports: every
 * frame waits the same time, so the queue is in due-time order.
 */
#define _GNU_SOURCE
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

#define MAX_PORTS 16
#define MAX_FRAME 65600
#define MACS 64

struct frame {
    struct frame *next;
    uint64_t due;
    int port, len;
    unsigned char data[];
};

static struct frame *head, *tail;
static volatile sig_atomic_t stop;
static struct { unsigned char mac[6]; int port; } macs[MACS];
static int nmacs;
static unsigned long dropped, forwarded, lost;
static uint64_t rng_state = 88172645463325252ull;

/* xorshift64: the loss draws need no quality beyond independence at this rate */
static uint64_t next_random(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void on_signal(int sig) { (void)sig; stop = 1; }

static int open_tap(const char *name) {
    int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK);
    if (fd < 0) { perror("open /dev/net/tun"); exit(1); }
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TAP | IFF_NO_PI;
    strncpy(ifr.ifr_name, name, IFNAMSIZ - 1);
    if (ioctl(fd, TUNSETIFF, &ifr) < 0) { fprintf(stderr, "TUNSETIFF %s: %s\n", name, strerror(errno)); exit(1); }
    return fd;
}

static void learn(const unsigned char *src, int port) {
    if (src[0] & 1) return; /* a multicast source is no address */
    for (int i = 0; i < nmacs; i++)
        if (!memcmp(macs[i].mac, src, 6)) { macs[i].port = port; return; }
    if (nmacs < MACS) { memcpy(macs[nmacs].mac, src, 6); macs[nmacs++].port = port; }
}

static int port_of(const unsigned char *dst) {
    if (dst[0] & 1) return -1; /* broadcast, multicast: every port */
    for (int i = 0; i < nmacs; i++)
        if (!memcmp(macs[i].mac, dst, 6)) return macs[i].port;
    return -1;
}

static void send_frame(int *fds, int nports, const struct frame *f) {
    int to = port_of(f->data);
    for (int p = 0; p < nports; p++) {
        if (p == f->port || (to >= 0 && p != to)) continue;
        forwarded++;
        /* a full TAP queue (its host is not reading) drops the frame, as a busy link would */
        if (write(fds[p], f->data, (size_t)f->len) < 0) { dropped++; if (errno != EAGAIN && errno != EIO) perror("write"); }
    }
}

int main(int argc, char **argv) {
    uint64_t loss_ppm = 0;
    if (argc > 2 && !strcmp(argv[1], "-l")) {
        loss_ppm = (uint64_t)strtoull(argv[2], NULL, 10);
        argv += 2;
        argc -= 2;
    }
    if (argc < 3) { fprintf(stderr, "usage: wire [-l LOSS_PPM] DELAY_US TAP...\n"); return 2; }
    uint64_t delay = (uint64_t)strtoull(argv[1], NULL, 10) * 1000ull;
    rng_state ^= now_ns();
    int nports = argc - 2;
    if (nports > MAX_PORTS) { fprintf(stderr, "at most %d ports\n", MAX_PORTS); return 2; }
    int fds[MAX_PORTS];
    struct pollfd pfd[MAX_PORTS];
    for (int p = 0; p < nports; p++) {
        fds[p] = open_tap(argv[p + 2]);
        pfd[p].fd = fds[p];
        pfd[p].events = POLLIN;
    }
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    printf("ready\n");
    fflush(stdout);
    struct frame *spare = malloc(sizeof(struct frame) + MAX_FRAME);
    while (!stop) {
        struct timespec wait, *timeout = NULL;
        if (head) {
            uint64_t t = now_ns();
            uint64_t left = head->due > t ? head->due - t : 0;
            wait.tv_sec = (time_t)(left / 1000000000ull);
            wait.tv_nsec = (long)(left % 1000000000ull);
            timeout = &wait;
        }
        if (ppoll(pfd, (nfds_t)nports, timeout, NULL) < 0 && errno != EINTR) { perror("ppoll"); return 1; }
        for (int p = 0; p < nports; p++) {
            if (!(pfd[p].revents & POLLIN)) continue;
            for (;;) {
                ssize_t n = read(fds[p], spare->data, MAX_FRAME);
                if (n < 14) break;
                learn(spare->data + 6, p);
                if (loss_ppm && next_random() % 1000000ull < loss_ppm) { lost++; continue; }
                spare->port = p;
                spare->len = (int)n;
                spare->due = now_ns() + delay;
                if (delay == 0) { send_frame(fds, nports, spare); continue; }
                struct frame *f = malloc(sizeof(struct frame) + (size_t)n);
                memcpy(f, spare, sizeof(struct frame) + (size_t)n);
                f->next = NULL;
                if (tail) tail->next = f; else head = f;
                tail = f;
            }
        }
        uint64_t t = now_ns();
        while (head && head->due <= t) {
            struct frame *f = head;
            send_frame(fds, nports, f);
            head = f->next;
            if (!head) tail = NULL;
            free(f);
        }
    }
    fprintf(stderr, "wire: %lu frames forwarded, %lu dropped (queue full), %lu lost\n", forwarded, dropped, lost);
    return 0;
}
